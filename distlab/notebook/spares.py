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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import ipycompat
from ..cluster import warm
from ..cluster.launch import engine_start_args, wait_for_engines
from ..cluster.nodes import Network
from ..cluster.processes import ProcessGuard
from ..errors import DistlabError
from .config import LabConfig
from .world import World

__all__ = ["KeepsSpares"]


class KeepsSpares:
    """How a lab finds engines for a world: its spares first, the rest started (the state is ``LabCore``'s)."""

    config: LabConfig
    _client: Any
    _cluster: Any
    _world: World | None
    _network: Network | None
    _guard: ProcessGuard
    #: The pool: each spare engine's pid, and its engine set.
    _spares: dict[int, str]
    #: Engine ids of ranks that are gone (an old world's, a replaced rank's): a world never counts them.
    _retired: set[int]

    if TYPE_CHECKING:  # what LabCore provides

        @property
        def timeout(self) -> float: ...
        def _connect_client(self) -> None: ...

    @property
    def spares(self) -> int:
        """How many spare engines the lab holds now (forked; registered or about to be)."""
        return len(self._spares)

    def _start_engines(self, count: int, node: int | None = None) -> None:
        """Start ``count`` engines: on emulated node ``node``, or (None) spread over the nodes as the
        lab's configuration says; on this machine's loopback where the lab has no nodes."""
        network = self._network
        if network is None:
            self._cluster.start_engines_sync(count, **engine_start_args(self.config.local))
        else:
            network.reconnect()  # a node whose link a cell cut is reachable again for its new engines
            if node is not None:
                self._cluster.start_engines_sync(count, **engine_start_args(True, network.exec_prefix(node)))
            else:
                for each, per_node in enumerate(self.config.ranks_per_node()):
                    self._cluster.start_engines_sync(per_node, **engine_start_args(True, network.exec_prefix(each)))
        self._guard.update()

    def _gather_engines(self, count: int, node: int | None = None) -> list[int]:
        """The engine ids of ``count`` ranks of a new world (or a replacement, on ``node``): spares
        first, the rest started now; returns once every one has registered."""
        pool = dict(self._spares) if node is None else {}
        before = set(self._cluster.engines)
        if count > len(pool):
            self._start_engines(count - len(pool), node)
        if self._client is None:
            self._connect_client()
        client = self._client
        taken = frozenset(self._retired | {r.engine_id for r in (self._world.table if self._world else ())})
        started = [name for name in self._cluster.engines if name not in before]
        wait_for_engines(client, count, self.timeout, taken, self._cluster, started + sorted(set(pool.values())))
        return sorted(set(client.ids) - taken)[:count]

    def _claim_spares(self, pids: Iterable[int]) -> None:
        """Engines that became ranks (by pid) leave the pool."""
        ranks = set(pids)
        self._spares = {pid: name for pid, name in self._spares.items() if pid not in ranks}

    def _top_up_spares(self) -> None:
        """Fork the spares the pool lacks and return: they register on their own. Skipped while the
        template is busy (importing torchft for a healing lab), so that nothing waits on it: the next
        top-up (when a cell starts, after a restart) forks them."""
        self._adopt_spare_helpers()
        missing = self.config.spare_count - len(self._spares)
        if missing <= 0 or self._cluster is None or warm.busy():
            return
        try:
            name = self._cluster.start_engines_sync(missing, **engine_start_args(True))
        except DistlabError:
            return  # the template failed: the lab goes on without spares (a restart starts engines)
        for pid, _, _ in ipycompat.engine_states(self._cluster, [name]):
            self._spares[pid] = name
        self._guard.update()

    def _adopt_spare_helpers(self) -> None:
        """Each spare's nanny joins the groups the lab ends (it is started just after its engine)."""
        with contextlib.suppress(Exception):
            self._guard.adopt_engine_helpers(list(self._spares))
