"""What views of a lab are told, and the bus that tells them: the lab's side of its views.

A lab tells its observers (:class:`LabObserver`) when it starts, restarts, changes and stops, and
wraps each cell in their ``cell`` context; its poll listeners (:data:`Listener`) read every poll of a
running cell. That is how views (the panel's state file, the dashboard, progress bars, a class's
limits) attach to a lab without the lab knowing them.

This module imports nothing of distlab, not even for a type: an observer is told an :class:`ObservedLab`,
the part of a lab views read, so that a view imports this module and never the lab (``core.LabCore``)
nor the ``Lab`` that assembles it with its views; an import of either would close a circle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

__all__ = ["LabObserver", "Listener", "ObservedLab", "Observer", "ObserverBus"]

#: Called on every poll with ``(pending, final)``: pending maps rank -> AsyncResult.
Listener = Callable[[dict[int, Any], bool], None]


class ObservedLab(Protocol):
    """What an observer may read of, or ask, the lab that tells it (``core.LabCore`` has it, and so the
    ``Lab`` a person uses): whether it runs, its size, when its last cell ended; its poll listeners; its
    stop when no cell runs (a class's idle end)."""

    @property
    def running(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    @property
    def last_cell_at(self) -> float | None: ...
    def add_listener(self, listener: Listener) -> None: ...
    def remove_listener(self, listener: Listener) -> None: ...
    def stop_unless_busy(self, still: Callable[[], bool]) -> bool: ...


class LabObserver(Protocol):
    """What a view of a lab is told. Observers must be quick and must not raise into the lab.

    ``lab`` is the lab that tells (``notebook.core.LabCore``, or the ``Lab`` a person uses), as much of it
    as an observer reads (:class:`ObservedLab`)."""

    def started(self, lab: ObservedLab) -> None: ...
    def restarted(self, lab: ObservedLab) -> None: ...
    def changed(self, lab: ObservedLab) -> None: ...
    def stopped(self, lab: ObservedLab) -> None: ...
    def cell(self, lab: ObservedLab, stream: bool) -> contextlib.AbstractContextManager[None]: ...


class Observer:
    """A :class:`LabObserver` that does nothing: subclass it and override what you need."""

    def started(self, lab: ObservedLab) -> None:
        pass

    def restarted(self, lab: ObservedLab) -> None:
        pass

    def changed(self, lab: ObservedLab) -> None:
        pass

    def stopped(self, lab: ObservedLab) -> None:
        pass

    @contextlib.contextmanager
    def cell(self, lab: ObservedLab, stream: bool) -> Iterator[None]:
        yield


class ObserverBus:
    """One lab's observers and poll listeners, told in the order they were added.

    ``owner`` is the lab the observers are told about (what they are given as ``lab``)."""

    def __init__(self, owner: ObservedLab) -> None:
        self._owner = owner
        self._observers: list[LabObserver] = []
        self._listeners: list[Listener] = []

    def observe(self, observer: LabObserver) -> None:
        self._observers.append(observer)

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def tell(self, event: str) -> None:
        """``started``, ``restarted``, ``changed`` or ``stopped``, to every observer."""
        for observer in list(self._observers):
            getattr(observer, event)(self._owner)

    def poll(self, pending: dict[int, Any], final: bool) -> None:
        """One poll of a running cell, to every listener."""
        for listener in list(self._listeners):
            listener(pending, final)

    def cell_views(self, stream: bool, ended: Callable[[], None]) -> contextlib.ExitStack:
        """What observers show while a cell runs (progress bars), entered in order; ``ended`` is
        called when the cell ends, before the views' exits (last in, first out): they see its end."""
        views = contextlib.ExitStack()
        try:
            for observer in list(self._observers):
                views.enter_context(observer.cell(self._owner, stream))
            views.callback(ended)
        except BaseException:
            views.close()
            raise
        return views
