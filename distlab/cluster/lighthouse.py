"""torchft's lighthouse for a healing lab: the process that forms each step's quorum of ranks.

    lighthouse = Lighthouse.start(host="127.0.0.1", folder=lab_folder)
    lighthouse.address      # "http://127.0.0.1:PORT": what each rank's torchft Manager is given
    lighthouse.stop()

It is torchft's own compiled server (what ``torchft_lighthouse``, installed with torchft, runs;
started here without importing torch: ``torchftcompat_lighthouse``), bound to the lab's address
only, on a port the kernel chose. A replica whose heartbeats stop for
``HEARTBEAT_TIMEOUT_MS`` is out of the next quorum: that is how long the survivors of a death wait
before they commit a step without it (torchft's default is 5 s; measured in ``../shared/FACTS.md``).
It starts in a session of its own so that the lab's guard can end it with everything else.

Its state is soft (the replicas it hears from, the quorum it last formed), so one started again on
the same address carries on: :meth:`Lighthouse.again` (``notebook.healing`` does it when one dies).
Its pid is written in the lab's folder (``wire.LIGHTHOUSE_PID_FILE``), where ``distlab.chaos`` reads it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import DistlabError, LabUsageError
from ..wire import LIGHTHOUSE_PID_FILE

__all__ = ["HEARTBEAT_TIMEOUT_MS", "JOIN_TIMEOUT_MS", "Lighthouse", "command", "executable"]

#: Heartbeats a replica may miss before the quorum goes on without it.
HEARTBEAT_TIMEOUT_MS = 1000
#: How often the lighthouse looks for a quorum while replicas gather.
QUORUM_TICK_MS = 50
#: How long a quorum waits for a replica that heartbeats but has not asked to join (a straggler)
#: before it forms without it; the straggler joins a later quorum and heals there. Under the ranks'
#: quorum timeout (``wire.HEALING_QUORUM_TIMEOUT_S``), so that the others' wait ends in a quorum,
#: not in a failure (torchft's default, 60 s, is past it); torchft's Slurm example uses 10 s.
JOIN_TIMEOUT_MS = 10_000
_LISTENING = re.compile(r"listening on: \S+:(\d+)")


def executable() -> str:
    """The ``torchft_lighthouse`` beside this Python, or a usage error that says how to get it."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = beside if os.access(beside, os.X_OK) else shutil.which("torchft_lighthouse")
    if not found:
        raise LabUsageError("healing needs torchft: pip install 'distlab[heal]' (torchft 0.2.0), then start again")
    return found


def command() -> list[str]:
    """How the lighthouse is started: torchft's compiled server loaded alone (``torchftcompat_lighthouse``:
    a fraction of a second, where torchft's own ``torchft_lighthouse`` imports torch first)."""
    executable()  # torchft is installed, or one line says how to get it
    return [sys.executable, os.path.join(os.path.dirname(__file__), "torchftcompat_lighthouse.py")]


@dataclass
class Lighthouse:
    """A running lighthouse: its process and the address ranks reach it at."""

    proc: subprocess.Popen[bytes]
    address: str
    log: str
    host: str = ""
    folder: str = ""
    prefix: tuple[str, ...] = ()

    @classmethod
    def start(
        cls, host: str, folder: str, timeout_s: float = 30.0, prefix: Sequence[str] = (), port: int = 0
    ) -> Lighthouse:
        """Start one, bound to ``host`` (and ``port``; 0: one the kernel chooses); ``prefix`` runs it
        where that address is (on emulated nodes, the switch's namespace: ``Network.exec_prefix(None)``,
        which execs it, pid and all)."""
        log = os.path.join(folder, "lighthouse.log")
        with open(log, "ab" if port else "wb") as out:  # one started again adds to the log
            start = out.tell()
            proc = subprocess.Popen(
                [*prefix, *command(), "--bind", f"{host}:{port}", "--min_replicas", "1",
                 "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS), "--quorum_tick_ms", str(QUORUM_TICK_MS),
                 "--join_timeout_ms", str(JOIN_TIMEOUT_MS)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")},
                start_new_session=True,
            )
        lighthouse = cls(proc, "", log, host, folder, tuple(prefix))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            with open(log, errors="replace") as f:
                f.seek(start)
                match = _LISTENING.search(f.read())
            if match:
                # It names the machine's host name; ranks are given the address it is bound to.
                lighthouse.address = f"http://{host}:{match.group(1)}"
                with open(os.path.join(folder, LIGHTHOUSE_PID_FILE), "w") as f:
                    f.write(str(proc.pid))
                return lighthouse
            time.sleep(0.02)
        lighthouse.stop()
        with open(log, errors="replace") as f:
            f.seek(start)
            said = f.read().strip().splitlines()[-3:]
        raise DistlabError(
            f"torchft's lighthouse did not start within {timeout_s:g} s: {' / '.join(said) or 'no output'}"
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def again(self, timeout_s: float = 30.0) -> Lighthouse:
        """This one, ended, started again on the same address: the ranks' managers reach it there."""
        self.stop()
        return Lighthouse.start(self.host, self.folder, timeout_s, self.prefix, self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)
