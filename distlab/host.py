"""This machine and its processes, as both sides ask them: the machine's id, whether a pid runs.

Plain functions of the operating system, imported by the notebook (which signals and reaps what it
started), by the ranks (an engine says which machine it is on) and by the Jupyter server.
"""

from __future__ import annotations

import functools
import os

__all__ = ["machine_id", "pid_alive"]


@functools.cache  # a process never moves to another machine
def machine_id() -> str:
    """Which machine this is: the kernel's boot id, the same in every namespace of one machine.

    Host names differ between the emulated nodes of one machine (and may repeat across real ones);
    the notebook signals and reaps a rank's process itself only where this matches its own.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead); pids <= 0 never do (kill(0) would mean a group)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
