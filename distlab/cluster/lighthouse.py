"""torchft's lighthouse for a healing lab: the process that forms each step's quorum of ranks.

    lighthouse = Lighthouse.start(host="127.0.0.1", folder=lab_folder)
    lighthouse.address      # "http://127.0.0.1:PORT": what each rank's torchft Manager is given
    lighthouse.stop()

It is torchft's own compiled server (``torchft_lighthouse``, installed with torchft), bound to the
lab's address only, on a port the kernel chose. A replica whose heartbeats stop for
``HEARTBEAT_TIMEOUT_MS`` is out of the next quorum: that is how long the survivors of a death wait
before they commit a step without it (torchft's default is 5 s; measured in ``../shared/FACTS.md``).
It starts in a session of its own so that the lab's guard can end it with everything else.
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

__all__ = ["HEARTBEAT_TIMEOUT_MS", "Lighthouse", "executable"]

#: Heartbeats a replica may miss before the quorum goes on without it.
HEARTBEAT_TIMEOUT_MS = 1000
#: How often the lighthouse looks for a quorum while replicas gather.
QUORUM_TICK_MS = 50
_LISTENING = re.compile(r"listening on: \S+:(\d+)")


def executable() -> str:
    """The ``torchft_lighthouse`` beside this Python, or a usage error that says how to get it."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = beside if os.access(beside, os.X_OK) else shutil.which("torchft_lighthouse")
    if not found:
        raise LabUsageError("healing needs torchft: pip install 'distlab[heal]' (torchft 0.2.0), then start again")
    return found


@dataclass
class Lighthouse:
    """A running lighthouse: its process and the address ranks reach it at."""

    proc: subprocess.Popen[bytes]
    address: str
    log: str

    @classmethod
    def start(cls, host: str, folder: str, timeout_s: float = 30.0, prefix: Sequence[str] = ()) -> Lighthouse:
        """Start one, bound to ``host``; ``prefix`` runs it where that address is (on emulated
        nodes, the switch's namespace: ``Network.exec_prefix(None)``, which execs it, pid and all)."""
        log = os.path.join(folder, "lighthouse.log")
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*prefix, executable(), "--bind", f"{host}:0", "--min_replicas", "1",
                 "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS), "--quorum_tick_ms", str(QUORUM_TICK_MS)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")},
                start_new_session=True,
            )
        lighthouse = cls(proc, "", log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            with open(log, errors="replace") as f:
                match = _LISTENING.search(f.read())
            if match:
                # It names the machine's host name; ranks are given the address it is bound to.
                lighthouse.address = f"http://{host}:{match.group(1)}"
                return lighthouse
            time.sleep(0.02)
        lighthouse.stop()
        with open(log, errors="replace") as f:
            said = f.read().strip().splitlines()[-3:]
        raise DistlabError(
            f"torchft's lighthouse did not start within {timeout_s:g} s: {' / '.join(said) or 'no output'}"
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)
