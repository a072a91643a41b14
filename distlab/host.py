"""This machine and its processes, as both sides ask them: the machine's id, whether a pid runs,
entering a network namespace.

Plain functions of the operating system, imported by the notebook (which signals and reaps what it
started), by the ranks (an engine says which machine it is on) and by the Jupyter server.
"""

from __future__ import annotations

import functools
import os

__all__ = ["CLONE_NEWNET", "enter_network_namespace", "machine_id", "pid_alive"]

#: setns(2)'s flag for a network namespace (<sched.h>); os.setns is Python 3.12's.
CLONE_NEWNET = 0x40000000


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


def enter_network_namespace(path: str, what: str) -> None:
    """Move the calling process into the network namespace at ``path`` (under /run/netns), as a
    child does after a fork, before it opens a socket. Refused: OSError naming ``what``."""
    import ctypes

    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"entering {what}: {os.strerror(errno)}")
    finally:
        os.close(fd)
