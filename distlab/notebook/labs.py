"""The running labs of this process: the one registry of them, and what watches them come and go.

Every lab that starts is here until it stops, by id (``lab-<pid>-<id in hex>``, the name of its
state file for the side panel), so that

- the side panel's Stop and Restart reach it however it was started (``get``);
- whatever still runs when the interpreter exits is stopped (``stop_all``, registered at exit);
- ``%exercise`` and ``%quiz`` find the lab ``%dist`` started in this IPython session (``current``).

A lab tells its observers (``LabObserver``) when it starts, restarts, changes and stops, and wraps
each cell in their ``cell`` context: that is how views (the panel's state file, the dashboard,
progress bars) attach to a lab without the lab knowing them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .core import LabCore

__all__ = ["LabObserver", "Observer", "add", "current", "get", "id_of", "remove", "running", "set_current", "stop_all"]


class LabObserver(Protocol):
    """What a view of a lab is told. Observers must be quick and must not raise into the lab."""

    def started(self, lab: LabCore) -> None: ...
    def restarted(self, lab: LabCore) -> None: ...
    def changed(self, lab: LabCore) -> None: ...
    def stopped(self, lab: LabCore) -> None: ...
    def cell(self, lab: LabCore, stream: bool) -> contextlib.AbstractContextManager[None]: ...


class Observer:
    """A :class:`LabObserver` that does nothing: subclass it and override what you need."""

    def started(self, lab: LabCore) -> None:
        pass

    def restarted(self, lab: LabCore) -> None:
        pass

    def changed(self, lab: LabCore) -> None:
        pass

    def stopped(self, lab: LabCore) -> None:
        pass

    @contextlib.contextmanager
    def cell(self, lab: LabCore, stream: bool) -> Iterator[None]:
        yield


# Held strongly from start to stop: a lab the user no longer names (``distlab.start()`` in a cell
# of its own) still runs ranks, and the panel and the interpreter's exit must still reach it.
_running: dict[str, LabCore] = {}
# The lab %dist started, per IPython shell (by id): ``current``.
_current: dict[int, LabCore] = {}
_at_exit = False


def id_of(lab: LabCore) -> str:
    """The lab's id: unique among the live labs of this machine."""
    return f"lab-{os.getpid()}-{id(lab):x}"


def add(lab: LabCore) -> None:
    """A lab has started (called by the lab)."""
    global _at_exit
    if not _at_exit:
        atexit.register(stop_all)
        _at_exit = True
    _running[id_of(lab)] = lab


def remove(lab: LabCore) -> None:
    """A lab has stopped (called by the lab)."""
    _running.pop(id_of(lab), None)
    for shell, held in list(_current.items()):
        if held is lab:
            del _current[shell]


def get(lab_id: str) -> LabCore | None:
    return _running.get(lab_id)


def running() -> list[LabCore]:
    return list(_running.values())


def _shell_id() -> int | None:
    from IPython import get_ipython

    shell = get_ipython()
    return None if shell is None else id(shell)


def set_current(lab: LabCore | None, shell: Any = None) -> None:
    """Make ``lab`` the one ``current()`` returns in this IPython session (None: none)."""
    key = id(shell) if shell is not None else _shell_id()
    if key is None:
        return
    if lab is None:
        _current.pop(key, None)
    else:
        _current[key] = lab


def current(shell: Any = None) -> LabCore | None:
    """The running lab ``%dist start`` made in this IPython session, or None."""
    key = id(shell) if shell is not None else _shell_id()
    lab = _current.get(key) if key is not None else None
    return lab if lab is not None and lab.running else None


def stop_all() -> None:
    """Stop every running lab (at the interpreter's exit); a kept one is let go of instead, for
    another kernel to attach (``notebook.kept``)."""
    for lab in list(_running.values()):
        with contextlib.suppress(Exception):
            if lab.config.keep:
                lab.detach()
            else:
                lab.stop()
