"""Which processes are a lab's, and making sure none outlives it.

ipyparallel starts the controller and each engine in a session of its own, so each pid is also a
process-group id; each engine starts a nanny in yet another session. A :class:`ProcessGuard` knows
those groups, keeps them in a file that a small watchdog (``cluster.reaper``) reads, and kills them
when the lab stops: trusting the processes, not ipyparallel's stop call.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable

from .. import ipycompat
from ..host import machine_id, pid_alive  # the ranks ask these too: they live below both sides

__all__ = [
    "ProcessGuard", "kill_group", "machine_id", "pid_alive", "reap", "signal_all", "terminate", "wait_for",
]


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def wait_for(condition: Callable[[], bool], seconds: float, poll_s: float = 0.05) -> bool:
    """Poll ``condition`` until it holds (True) or ``seconds`` pass (False)."""
    deadline = time.monotonic() + seconds
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each process still there (one already gone is not an error)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def terminate(pids: Iterable[int], grace_s: float = 5.0) -> None:
    """SIGTERM every process at once, then wait (up to ``grace_s``) for all of them to exit.

    Each exits as it would on its own (buffers flushed, exit handlers run). ipyparallel's stop
    signals and waits for its engines one launcher at a time; this way a stop took 0.58-0.61x as
    long as ipyparallel's (benchmarks/RESULTS.md), and ipyparallel's stop that follows finds them
    gone. What is still there is killed later.
    """
    pids = list(pids)
    signal_all(pids, signal.SIGTERM)
    wait_for(lambda: not any(pid_alive(pid) for pid in pids), grace_s, poll_s=0.01)


def _dead(pid: int) -> bool:
    return not pid_alive(pid)


def reap(pids: Iterable[int], seconds: float = 5.0) -> None:
    """Wait for each process to end; kill what is still there after ``seconds``."""
    for pid in pids:
        if not wait_for(functools.partial(_dead, pid), seconds):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def remove_files(patterns: Iterable[str]) -> None:
    """Remove the files matching ``patterns`` (glob), those already gone or not removable skipped."""
    for pattern in patterns:
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError):
                os.unlink(path)


class ProcessGuard:
    """The process groups of one lab's cluster, and the watchdog that ends them if the notebook dies."""

    def __init__(self) -> None:
        self._cluster: ipycompat.IppCluster = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._pgid_file: str | None = None
        self._files: list[str] = []
        #: Groups each engine (by pid) started in sessions of their own (its nanny): ended with that
        #: engine only, so that a restart's end of the old world leaves a spare engine's nanny be.
        self._helpers: dict[int, set[int]] = {}
        #: Groups the lab started beside the cluster (a healing lab's lighthouse): they last until the stop.
        self._own: set[int] = set()
        self._lock = threading.Lock()  # _helpers: an old world's end (a thread) pops what the lab reads
        self._ending: list[threading.Thread] = []  # old worlds ending in the background

    def watch(
        self, cluster: ipycompat.IppCluster, folders: Iterable[str] = (), namespaces: Iterable[str] = (),
        keep: tuple[float, str] | None = None,
    ) -> None:
        """Start the watchdog for ``cluster`` (an ``ipyparallel.Cluster`` whose controller is up);
        if the notebook dies it also removes ``folders`` (files the lab made) and ``namespaces``
        (its nodes and switch, with their links and queues). ``keep``: (seconds, record) of a lab
        kept past its notebook (``notebook.kept``): the watchdog then waits that long for another
        process to take the record over before it ends the lab."""
        self._cluster = cluster
        # ipyparallel's files for this cluster (logs, connection files, the hub's engine state):
        # a stop leaves the engine state, a killed notebook all of them.
        self._files = ipycompat.cluster_files(cluster)
        fd, self._pgid_file = tempfile.mkstemp(prefix="distlab-", suffix=".pgids")
        os.close(fd)
        self.update()
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "distlab.cluster.reaper", str(os.getpid()), self._pgid_file,
             *(f"--netns={name}" for name in namespaces), *(f"--glob={pattern}" for pattern in self._files),
             *([f"--keep={keep[0]:g}:{keep[1]}"] if keep else []), *folders],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )

    @property
    def files(self) -> list[str]:
        """What the watchdog removes if the notebook dies: ipyparallel's files of the cluster (patterns)
        and the file it reads the process groups from."""
        return [*self._files, *([self._pgid_file] if self._pgid_file else [])]

    def pgids(self) -> list[int]:
        """Every process group of the cluster: controller, engine sets, engines, their helpers."""
        pids = ipycompat.launcher_pids(self._cluster) if self._cluster is not None else []
        with self._lock:
            helpers = set().union(*self._helpers.values())
        return sorted(set(pids) | helpers | self._own)

    def adopt(self, pgid: int) -> None:
        """A process group the lab started beside the cluster: ended with it, or by the watchdog."""
        self._own.add(pgid)
        self.update()

    def disown(self, pgid: int) -> None:
        """A group adopted before that has ended (a lighthouse that died): its number may be reused."""
        self._own.discard(pgid)
        self.update()

    def update(self) -> None:
        """Rewrite the watchdog's list (after engines started or stopped)."""
        if self._pgid_file is None:
            return
        # The file lives in the shared temporary folder: a fixed "<file>.tmp" name could be a link
        # another user planted there, which open() would follow. mkstemp makes a new file (0600,
        # O_EXCL) under a name nobody can guess; os.replace swaps it in whole, for the reaper.
        fd, tmp = tempfile.mkstemp(prefix=".distlab-", suffix=".pgids.tmp", dir=os.path.dirname(self._pgid_file))
        try:
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(str(p) for p in self.pgids()))
            os.replace(tmp, self._pgid_file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def adopt_engine_helpers(self, engine_pids: Iterable[int]) -> None:
        """Each engine starts a nanny (it reports the engine's death at once) in a session of its own;
        it would outlive a stop by seconds. Its group joins those the guard kills."""
        import psutil

        found = False
        for pid in engine_pids:
            if pid in self._helpers:  # one nanny an engine: found already
                continue
            with contextlib.suppress(psutil.Error, OSError):
                for child in psutil.Process(pid).children():
                    if os.getpgid(child.pid) == child.pid:
                        with self._lock:
                            self._helpers.setdefault(pid, set()).add(child.pid)
                        found = True
        if found:
            self.update()

    def end_engines_soon(self, engine_pids: Iterable[int], grace_s: float = 5.0) -> None:
        """In the background: wait (``grace_s``) for engines already signalled to exit, kill what is
        left, and their helpers. A restart returns once its new world works, not once the old one
        has gone; a stop (``end_all``) waits for this. The watchdog's list is left to the lab's next
        update (it reads ipyparallel's launchers, which only the lab's thread may)."""
        pids = list(engine_pids)

        def end() -> None:
            wait_for(lambda: not any(pid_alive(pid) for pid in pids), grace_s, poll_s=0.02)
            reap(pids, seconds=0.0)  # what the grace left is killed now
            self._end_helpers(pids)

        thread = threading.Thread(target=end, daemon=True, name="distlab-end-old-world")
        thread.start()
        self._ending = [t for t in self._ending if t.is_alive()] + [thread]

    def _end_helpers(self, engine_pids: list[int]) -> None:
        with self._lock:
            groups = [self._helpers.pop(pid, set()) for pid in engine_pids]
        for group in groups:
            for pgid in group:
                kill_group(pgid)

    def end_all(self, pgids: Iterable[int], engine_pids: Iterable[int]) -> None:
        """After ipyparallel stopped the cluster: kill every group still standing, remove the
        cluster's files. The watchdog stays until :meth:`close`, once the lab has removed what it
        made beside the cluster (its folder, its network).

        ``pgids``: :meth:`pgids` as it was before the stop (ipyparallel forgets its launchers' pids).
        """
        for pgid in pgids:
            kill_group(pgid)
        reap(engine_pids)
        for thread in self._ending:  # an old world still ending: its processes were killed above
            thread.join(10.0)
        self._ending = []
        with self._lock:
            self._helpers = {}
        self._own = set()
        self._cluster = None
        remove_files(self._files)
        self._files = []

    def release(self) -> None:
        """Let go of the cluster without ending it (a kept lab let go of): its watchdog stays, to end
        it if nobody takes it back."""
        self._reaper, self._pgid_file, self._cluster = None, None, None
        self._helpers, self._own, self._files = {}, set(), []

    def close(self) -> None:
        """Stop the watchdog: the last step of a lab's stop. Until then a notebook killed part way
        through the stop (a kernel's shutdown kills one whose stop outlasts its wait: 2.5 s, then
        SIGTERM) leaves nothing behind, the watchdog removing what the stop had not reached."""
        if self._reaper is not None:
            self._reaper.terminate()
            try:
                self._reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
                self._reaper.wait(timeout=5)
            self._reaper = None
        if self._pgid_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._pgid_file)
            self._pgid_file = None
