"""Spare engines: started and registered beside a lab's world before anyone asks for them.

A restart (a new world) or a healing lab's replacement for a dead rank takes spares instead of
starting engines: it then waits only for what a world needs of engines that are already there
(describing them, the rendezvous, the first all-reduce), not for a start and a registration. What
was taken is forked again once the lab has its world (the pool is topped up after).

Spares are forked from the warm template (``cluster.warm``), so only a local lab without nodes keeps
them (``LabConfig.forks_spares``); an old world of such a lab is ended by its processes' pids, never
by its engine sets, which may hold spares too. A spare is an idle engine: no process group, no torch.distributed
state, none of the lab's names (it runs nothing until it is a rank). Nothing outlives the lab: spares
are its cluster's engines, stopped with it and listed for the watchdog as every rank is.

:class:`SparePool` is the pool; ``processes.LabProcesses`` holds one and takes from it first
(``gather_engines``) when a world or a replacement needs engines.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterable

from .. import ipycompat
from ..cluster import warm
from ..cluster.launch import engine_start_args
from ..cluster.processes import ProcessGuard, signal_all
from ..errors import DistlabError

__all__ = ["SparePool"]


class SparePool:
    """A lab's spare engines: each one's pid, and the engine set it was started in.

    ``guard`` is the lab's process guard: a spare's nanny joins the groups it ends."""

    def __init__(self, guard: ProcessGuard) -> None:
        self._guard = guard
        self._pool: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._pool)

    def pids(self) -> list[int]:
        return list(self._pool)

    def engine_sets(self) -> set[str]:
        """The engine sets spares were started in (a restart must not stop them)."""
        return set(self._pool.values())

    def claim(self, pids: Iterable[int]) -> None:
        """Engines that became ranks (by pid) leave the pool."""
        ranks = set(pids)
        self._pool = {pid: name for pid, name in self._pool.items() if pid not in ranks}

    def top_up(self, cluster: ipycompat.IppCluster, wanted: int) -> None:
        """Fork the spares the pool lacks of ``wanted`` in ``cluster`` and return: they register on
        their own. Skipped while the template is busy (importing torchft for a healing lab), so that
        nothing waits on it: the next top-up (when a cell starts, after a restart) forks them."""
        self.adopt_helpers()
        missing = wanted - len(self._pool)
        if missing <= 0 or cluster is None or warm.busy():
            return
        try:
            name = cluster.start_engines_sync(missing, **engine_start_args(True))
        except DistlabError:
            return  # the template failed: the lab goes on without spares (a restart starts engines)
        for pid, _, _ in ipycompat.engine_states(cluster, [name]):
            self._pool[pid] = name
        self._guard.update()

    def adopt_helpers(self) -> None:
        """Each spare's nanny joins the groups the lab ends (it is started just after its engine)."""
        with contextlib.suppress(Exception):  # a spare already gone: the others' helpers still join
            self._guard.adopt_engine_helpers(list(self._pool))

    def kill_all(self) -> list[int]:
        """End every spare at once (idle engines: nothing of theirs to flush or wait for); their pids."""
        self.adopt_helpers()
        pids, self._pool = list(self._pool), {}
        signal_all(pids, signal.SIGKILL)
        return pids

    def clear(self) -> None:
        self._pool = {}
