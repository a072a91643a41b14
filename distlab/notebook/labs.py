"""The running labs of this process: the one registry of them, and what watches them come and go.

Every lab that starts is here until it stops, by id (``lab-<pid>-<id in hex>``, the name of its
state file for the side panel), so that

- the side panel's Stop and Restart reach it however it was started (``get``);
- whatever still runs when the interpreter exits is stopped (``stop_all``, registered at exit);
- ``%exercise`` and ``%quiz`` find the lab ``%dist`` started in this IPython session (``current``).

It imports nothing of the lab (a lab adds itself when it starts and removes itself when it stops),
so that views and the panel's server reach labs through it without an import of the lab.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .pause import Pause

__all__ = ["RegisteredLab", "add", "current", "get", "id_of", "remove", "running", "set_current", "stop_all"]


class RegisteredLab(Protocol):
    """What the registry asks of a lab (``core.LabCore`` and the ``Lab`` a person uses have it)."""

    @property
    def running(self) -> bool: ...
    @property
    def config(self) -> Any: ...
    @property
    def world_size(self) -> int: ...
    def stop(self) -> None: ...
    def restart(self, ranks: int | None = None) -> Any: ...
    def detach(self) -> None: ...
    @property
    def paused(self) -> Pause | None: ...
    def step(self) -> Pause | None: ...
    def cont(self) -> Any: ...


# Held strongly from start to stop: a lab the user no longer names (``distlab.start()`` in a cell
# of its own) still runs ranks, and the panel and the interpreter's exit must still reach it.
_running: dict[str, RegisteredLab] = {}
# The lab %dist started, per IPython shell (by id): ``current``.
_current: dict[int, RegisteredLab] = {}
_at_exit = False


def id_of(lab: object) -> str:
    """The lab's id: unique among the live labs of this machine."""
    return f"lab-{os.getpid()}-{id(lab):x}"


def add(lab: RegisteredLab) -> None:
    """A lab has started (called by the lab)."""
    global _at_exit
    if not _at_exit:
        atexit.register(stop_all)
        _at_exit = True
    _running[id_of(lab)] = lab


def remove(lab: RegisteredLab) -> None:
    """A lab has stopped (called by the lab)."""
    _running.pop(id_of(lab), None)
    for shell, held in list(_current.items()):
        if held is lab:
            del _current[shell]


def get(lab_id: str) -> RegisteredLab | None:
    return _running.get(lab_id)


def running() -> list[RegisteredLab]:
    return list(_running.values())


def _shell_id() -> int | None:
    from IPython import get_ipython

    shell = get_ipython()
    return None if shell is None else id(shell)


def set_current(lab: RegisteredLab | None, shell: Any = None) -> None:
    """Make ``lab`` the one ``current()`` returns in this IPython session (None: none)."""
    key = id(shell) if shell is not None else _shell_id()
    if key is None:
        return
    if lab is None:
        _current.pop(key, None)
    else:
        _current[key] = lab


def current(shell: Any = None) -> RegisteredLab | None:
    """The running lab ``%dist start`` made in this IPython session, or None."""
    key = id(shell) if shell is not None else _shell_id()
    lab = _current.get(key) if key is not None else None
    return lab if lab is not None and lab.running else None


def stop_all() -> None:
    """Stop every running lab (at the interpreter's exit); a kept one is let go of instead, for
    another kernel to attach (``notebook.kept``)."""
    for lab in list(_running.values()):
        with contextlib.suppress(Exception):  # at exit: one lab's failure must not keep the others up
            if lab.config.keep:
                lab.detach()
            else:
                lab.stop()
