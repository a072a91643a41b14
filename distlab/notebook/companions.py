"""Labs a lab keeps for its own purposes (an exercise's grader): started on first use, stopped with it.

A companion is a plain core (no panel entry, no dashboard, no progress bars) that shares its lab's
lock, so that another thread stopping the lab waits for the companion's work too. This module never
imports the lab: the lab hands it the factory that makes a companion.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["Companion", "Companions"]


class Companion(Protocol):
    """What this module asks of a companion lab (``LabCore`` has it)."""

    lock: threading.RLock

    @property
    def running(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    @property
    def whole(self) -> bool: ...

    def start(self) -> object: ...

    def restart(self, ranks: int | None = None) -> object: ...

    def stop(self) -> None: ...


C = TypeVar("C", bound=Companion)


class Companions(Generic[C]):
    """The companions of one lab, by name. ``make(ranks, backend)`` builds one, not yet started."""

    def __init__(self, make: Callable[[int, str], C], lock: threading.RLock) -> None:
        self._make = make
        self._lock = lock
        self._labs: dict[str, C] = {}

    def get(self, name: str, ranks: int, backend: str) -> C:
        """The companion ``name`` of ``ranks`` ranks, running and whole: started on first use (or
        once stopped), restarted at another size or when one of its ranks died."""
        lab = self._labs.get(name)
        if lab is None or not lab.running:
            lab = self._make(ranks, backend)
            lab.lock = self._lock
            lab.start()
            self._labs[name] = lab
        elif lab.world_size != ranks or not lab.whole:
            lab.restart(ranks=ranks)
        return lab

    def __getitem__(self, name: str) -> C:
        return self._labs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._labs)

    def stop_all(self) -> list[BaseException]:
        """Stop every companion and forget them; what each that failed to stop raised (the lab
        stops anyway, and raises the first once it has)."""
        labs, self._labs = list(self._labs.values()), {}
        errors: list[BaseException] = []
        for lab in labs:
            try:
                lab.stop()
            except Exception as exc:  # noqa: BLE001 - handed back: the lab raises it once it has stopped
                errors.append(exc)
        return errors
