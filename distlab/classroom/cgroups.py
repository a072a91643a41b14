"""A learner's control group: the cores and memory the instructor gives them, and every process of theirs.

The hub (root) makes one group per running learner server, ``distlab-<hub pid>-<user>``, in each
hierarchy it uses, and the server joins it before it becomes the learner (``join``, run in the
forked child). Every process the learner then starts (kernels, controllers, engines, nodes in
user namespaces of their own) stays in the group: a user may not move a process out of a group
that root owns. So the group is both the limit and the list of what to end when the server stops
(``end``), whatever escaped its session or its parent.

Control groups v2 (one tree, ``cpu.max`` and ``memory.max``) where the kernel mounts them so, else
v1 (``cpu/`` with ``cpu.cfs_quota_us``, ``memory/`` with ``memory.limit_in_bytes``). A limit the
kernel offers no controller for raises one line at the server's start, before it runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

__all__ = ["LearnerGroup", "cgroup_missing", "remove_orphans"]

_ROOT = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000
_PREFIX = "distlab-"


def _v2() -> bool:
    return (_ROOT / "cgroup.controllers").exists()


def cgroup_missing(cores: float | None, memory: int | None) -> str | None:
    """Why the limits cannot be enforced here (one line), or None."""
    if not cores and not memory:
        return None
    if os.geteuid() != 0:
        return "limiting cores and memory needs root (the hub runs as root to start learners' servers)"
    wanted = (["cpu"] if cores else []) + (["memory"] if memory else [])
    if _v2():
        offered = (_ROOT / "cgroup.controllers").read_text().split()
        missing = [c for c in wanted if c not in offered]
    else:
        missing = [c for c in wanted if not (_ROOT / c).is_dir() or not os.access(_ROOT / c, os.W_OK)]
    if missing:
        return (f"this kernel offers no writable {' or '.join(missing)} control group under {_ROOT}: "
                "run the hub where it does, or leave out the cores and memory limits")
    return None


class LearnerGroup:
    """One learner server's group: made with its limits, joined by the server, ended with it."""

    def __init__(self, name: str, cores: float | None = None, memory: int | None = None) -> None:
        self.name = name
        self.cores = cores
        self.memory = memory
        # v1: one folder per hierarchy (cpu always, to list the processes; memory when limited)
        if _v2():
            self.folders = [_ROOT / name]
        else:
            self.folders = [_ROOT / "cpu" / name] + ([_ROOT / "memory" / name] if memory else [])

    def make(self) -> None:
        if _v2():
            self._enable_controllers()
        for folder in self.folders:
            folder.mkdir(exist_ok=True)
        if _v2():
            folder = self.folders[0]
            if self.cores:
                (folder / "cpu.max").write_text(f"{round(self.cores * _PERIOD_US)} {_PERIOD_US}")
            if self.memory:
                (folder / "memory.max").write_text(str(self.memory))
            return
        if self.cores:
            (self.folders[0] / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (self.folders[0] / "cpu.cfs_quota_us").write_text(str(round(self.cores * _PERIOD_US)))
        if self.memory:
            (self.folders[1] / "memory.limit_in_bytes").write_text(str(self.memory))

    def _enable_controllers(self) -> None:
        wanted = " ".join(f"+{c}" for c, on in (("cpu", self.cores), ("memory", self.memory)) if on)
        if wanted:
            (_ROOT / "cgroup.subtree_control").write_text(wanted)

    def join(self) -> None:
        """Put the calling process in the group (run after fork, before the process drops root)."""
        for folder in self.folders:
            with open(folder / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def pids(self) -> list[int]:
        try:
            text = (self.folders[0] / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def end(self, grace_s: float = 3.0) -> None:
        """SIGTERM every process in the group, SIGKILL what is left after ``grace_s``, then remove
        the group (the kernel refuses while a process is in it: wait, bounded, for them to go)."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
        for folder in self.folders:
            deadline = time.monotonic() + 5.0
            while folder.exists():
                try:
                    folder.rmdir()
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: a process killed a moment ago is still leaving the group
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


def remove_orphans(alive: int | None = None) -> list[str]:
    """Remove the groups of hubs that are gone (their pid is in the name), ending what is left in
    them; ``alive``: a hub pid to keep whatever its state (this hub). The names removed."""
    from ..cluster.processes import pid_alive

    tops = [_ROOT] if _v2() else [_ROOT / "cpu", _ROOT / "memory"]
    removed = []
    for top in tops:
        with contextlib.suppress(OSError):
            for folder in top.glob(f"{_PREFIX}*"):
                try:
                    pid = int(folder.name.split("-")[1])
                except (IndexError, ValueError):
                    continue
                if pid == alive or pid_alive(pid):
                    continue
                group = LearnerGroup(folder.name)
                group.folders = [folder]
                with contextlib.suppress(OSError):
                    group.end(grace_s=0.5)
                    removed.append(folder.name)
    return removed
