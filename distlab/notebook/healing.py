"""The healing half of a lab (``heal=True``), mixed into ``LabCore``: torchft's lighthouse beside the
ranks, a new process in a dead rank's place, and one whole group again after a healing cell.

- ``cluster.lighthouse``: the lighthouse process;  ``rank.heal``: the quorum on each rank;
- ``cell.CellRun`` asks for a replacement (``_replace_rank``) when a rank dies while a cell runs;
  ``cells`` asks for one before a cell (``_replace_before``) and after it (``_whole_again``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..cluster import warm
from ..cluster.lighthouse import Lighthouse
from ..cluster.nodes import Network
from ..cluster.processes import ProcessGuard
from ..errors import DistlabError, RankError, format_ranks
from ..wire import HEALING_MODULES, HEALING_RANK_ENVIRONMENT
from . import rpc
from .config import LabConfig
from .group import form_group, get, group_spec
from .release import Releaser
from .world import RankInfo, World

__all__ = ["HealsRanks"]


class HealsRanks:
    """What a lab that heals does beyond one that does not (the state is ``LabCore``'s)."""

    config: LabConfig
    _client: Any
    _cluster: Any
    _world: World | None
    _network: Network | None
    _folder: str | None
    _lighthouse: Lighthouse | None
    _guard: ProcessGuard
    _releaser: Releaser
    _pushed: dict[str, Any]
    _retired: set[int]

    if TYPE_CHECKING:  # what LabCore provides

        @property
        def timeout(self) -> float: ...
        @property
        def debug(self) -> bool: ...
        def _phase(self, name: str) -> None: ...
        def _controller_ip(self) -> str: ...
        def _gather_engines(self, count: int, node: int | None = None) -> list[int]: ...
        def _claim_spares(self, pids: Iterable[int]) -> None: ...

    def _stop_lighthouse(self) -> None:
        lighthouse, self._lighthouse = self._lighthouse, None
        if lighthouse is not None:
            lighthouse.stop()  # ended with the lab's process groups already: reaped here

    def _start_lighthouse(self) -> None:
        """torchft's lighthouse, on the address the ranks reach the controller at (loopback, or the
        switch's on emulated nodes), ended with the lab (or by its guard, if the notebook dies)."""
        assert self._folder is not None
        prefix = self._network.exec_prefix(None) if self._network is not None else ()
        self._lighthouse = Lighthouse.start(self._controller_ip(), self._folder, self.timeout, prefix)
        self._guard.adopt(self._lighthouse.pid)
        if self._network is None and self.config.launcher == "local" and warm.enabled():
            # A replacement rank is forked from the template: with torchft there, it starts with it.
            # In the background: the lab's own ranks are forked first.
            threading.Thread(target=_preload_healing, daemon=True, name="distlab-preload-torchft").start()
        self._phase("lighthouse_s")

    @property
    def _healing(self) -> tuple[str, str]:
        """What ranks are told where the lab heals: its lighthouse, and the file a healing cell's end is written to."""
        if self._lighthouse is None or self._folder is None:
            return ("", "")
        return (self._lighthouse.address, os.path.join(self._folder, "heal-end"))

    def _replace_rank(self, rank: int) -> tuple[Any, RankInfo]:
        """A new engine in the place of rank ``rank``, which died while a healing cell ran: started
        (forked where ranks are warm) on the dead rank's node, told it is that rank, with everything
        but the process group (``rank.group.join_as_replacement``). Its engine view and table row."""
        assert self._world is not None
        old = self._world.table[rank]
        client = self._client
        # A spare where the lab keeps them; else an engine started on the dead rank's node.
        node = self._world.hosts().index(old.host) if self._network else None
        (engine_id,) = self._gather_engines(1, node)
        (identity,) = get(rpc.describe(client.direct_view([engine_id]), self._controller_ip()), self.timeout,
                          f"describing rank {rank}'s replacement")
        self._claim_spares([identity["pid"]])
        self._retired.add(old.engine_id)
        new = replace(old, engine_id=engine_id, pid=identity["pid"], addr=identity["addr"], health="ok")
        table = list(self._world.table)
        table[rank] = new
        self._world = replace(self._world, table=tuple(table))
        spec = group_spec(self._world, new, 0, self.timeout, self.debug, self._healing)
        get(rpc.join_as_replacement(client[engine_id], spec), self.timeout, f"making rank {rank}'s replacement")
        view = client.direct_view([engine_id])
        view.use_cloudpickle().get(timeout=self.timeout)
        if self._pushed:
            get(view.push(self._pushed, block=False), self.timeout, f"pushing to rank {rank}'s replacement")
        self._guard.adopt_engine_helpers([new.pid])
        return client[engine_id], new

    def _form_whole_group(self, replaced: list[int]) -> World:
        """Every rank, replacements included, in one process group again; replacements answer release requests."""
        assert self._world is not None
        world = self._world
        form_group(self._client, world, self.timeout, self.debug, rebuild=False, healing=self._healing)
        self._releaser.listen(self._client, [world.table[r] for r in replaced], self.timeout)
        return world

    def _replace_before(self, gone: list[int]) -> None:
        """In a lab that heals, ranks that died between cells (``%dist kill``) are started again before
        the next cell, and the whole group formed: they have none of the names earlier cells made."""
        for rank in gone:
            self._replace_rank(rank)
        self._form_whole_group(gone)
        print(
            f"[distlab] rank {format_ranks(gone)} had died: a new process took its place before this cell "
            "(it has none of the names earlier cells made)", flush=True,
        )

    def _whole_again(self, outcome: Any) -> None:
        """After a healing cell in which ranks were replaced: one process group of every rank again,
        for the next cell (a replacement joined the cell's quorum, never the old group), and notes
        that say what happened."""
        try:
            world = self._form_whole_group(list(outcome.replaced))
            src = min(r.rank for r in world.table if r.rank not in outcome.replaced)
            shares = [rpc.share_state(self._client[r.engine_id], src) for r in world.table]
            same = {get(ar, self.timeout, "comparing the ranks' healed state") for ar in shares}
        except (RankError, DistlabError) as exc:
            outcome.notes.append(f"the process group could not be formed again ({str(exc).splitlines()[0]}): "
                                 "%dist restart (lab.restart()) brings a full world back")
            return
        ranks = format_ranks(sorted(outcome.replaced))
        seconds = max(outcome.replaced.values())
        if same == {True}:
            how = "healed from a live peer and went on with the others, who did not stop; the replicas are identical"
        elif same == {False}:
            how = f"came after the others had ended the cell: it was given rank {src}'s model and optimizer at the end"
        else:
            how = "made no healing in the cell (distlab.heal) to compare"
        outcome.notes.append(f"rank {ranks} died; its replacement ran the cell {seconds:.1f} s later, {how}")


def _preload_healing() -> None:
    with contextlib.suppress(Exception):  # without it a replacement imports torchft itself (slower, as good)
        warm.current(os.environ).preload(HEALING_MODULES, HEALING_RANK_ENVIRONMENT)
