"""A lab's world: which engine is which rank (the rank table), and their process group.

:class:`LabWorld` turns engines into a world (``build``: describe them, plan the table, form the
group) and keeps it: a broken group rebuilt in place (``rebuild_group``), a dead rank's row given to
its replacement (``put``), every rank in one group again after a heal (``form_whole``). The rules
are ``world``'s (pure); forming the group is ``group``'s; what frees stuck ranks is ``release``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from ..errors import parse_ranks
from . import rpc
from .config import LabConfig
from .group import form_group, get
from .processes import LabProcesses, on_this_machine
from .release import Releaser
from .world import RankInfo, RankTable, World, plan_world

__all__ = ["LabWorld"]

#: What ranks are told where the lab heals: its lighthouse's address, and the file a healing cell's end
#: is written to; ("", "") where it does not heal.
Healing = tuple[str, str]


class LabWorld:
    """The world of a lab's ranks (None before its first, after a stop), on ``processes``' engines."""

    def __init__(self, processes: LabProcesses, timeout: float, debug: bool) -> None:
        self._processes = processes
        self._timeout = timeout
        self._debug = debug
        self.current: World | None = None
        self.releaser = Releaser()  # frees ranks stuck in a collective when a cell is stopped

    @property
    def table(self) -> RankTable:
        return RankTable(self.current.table if self.current is not None else ())

    @property
    def engine_ids(self) -> frozenset[int]:
        return frozenset(r.engine_id for r in self.table)

    def ranks(self, spec: str | int | Iterable[int] | None, world_size: int) -> list[int]:
        """Parse a rank selection ('0,2-3', 1, [0, 1], None for all) against a world of ``world_size``."""
        if spec is None:
            return list(range(world_size))
        return parse_ranks(spec, world_size)

    def local_pids(self) -> list[int]:
        """The pids of the ranks on this machine (the others are ended by their launcher)."""
        return [r.pid for r in self.table if on_this_machine(r)]

    def build(self, ids: list[int], config: LabConfig, healing: Healing, phase: Callable[[str], None]) -> World:
        """Rank table (of engines ``ids``), device checks, rendezvous, process group, and the ranks' namespace."""
        processes = self._processes
        client = processes.client
        network = processes.network
        identities = get(rpc.describe(client.direct_view(ids), processes.controller_ip()), self._timeout,
                         "describing the engines")
        phase("describe_s")  # includes engines finishing their import of torch
        nodes = [network.hostname(i) for i in range(network.nodes)] if network else []
        world = self.current = plan_world(dict(zip(ids, identities)), config.ranks, config.backend, host_order=nodes)
        processes.spares.claim(r.pid for r in world.table)
        form_group(client, world, self._timeout, self._debug, rebuild=False, healing=healing)
        phase("process_group_s")  # rendezvous, init_process_group, first all-reduce
        self.releaser.listen(client, world.table, self._timeout)
        processes.guard.adopt_engine_helpers(self.local_pids())
        # Let names defined in the notebook (functions, classes) travel to the ranks by value.
        client.direct_view(ids).use_cloudpickle().get(timeout=self._timeout)
        phase("namespace_s")
        return world

    def adopt(self, world: World) -> None:
        """A world formed elsewhere (a kept lab's, taken back): its ranks answer release requests."""
        self.current = world
        self.releaser.listen(self._processes.client, world.table, self._timeout)

    def rebuild_group(self) -> None:
        """A broken process group formed again in place, on the same processes."""
        assert self.current is not None
        form_group(self._processes.client, self.current, self._timeout, self._debug, rebuild=True)

    def put(self, rank: int, new: RankInfo) -> World:
        """Rank ``rank``'s row is ``new`` (a replacement's): the world with it."""
        assert self.current is not None
        table = list(self.current.table)
        table[rank] = new
        self.current = replace(self.current, table=tuple(table))
        return self.current

    def form_whole(self, replaced: list[int], healing: Healing) -> World:
        """Every rank, replacements included, in one process group again; replacements answer release requests."""
        assert self.current is not None
        world = self.current
        client = self._processes.client
        form_group(client, world, self._timeout, self._debug, rebuild=False, healing=healing)
        self.releaser.listen(client, [world.table[r] for r in replaced], self._timeout)
        return world

    def clear(self) -> None:
        self.current = None
