"""A lab that heals (``heal=True``): torchft's lighthouse beside the ranks, a new process in a dead
rank's place, one whole group again after a healing cell, and the record of what the last one did.

- ``cluster.lighthouse``: the lighthouse process;  ``rank.heal``: the quorum on each rank;
- ``cell.CellRun`` asks for a replacement (:meth:`Healer.replace_rank`) when a rank dies while a cell
  runs; ``cells.CellRunner`` asks for one before a cell (:meth:`Healer.replace_before`) and for the
  whole group after it (:meth:`Healer.whole_again`);
- ``healing_record``: the quorums and heals the ranks published, folded (``HealingRecords``, the
  healer's ``records``, keeps the last cell's: ``lab.heals()``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..cluster import warm
from ..cluster.lighthouse import Lighthouse
from ..errors import DistlabError, RankError, format_ranks
from ..wire import HEALING_MODULES, HEALING_RANK_ENVIRONMENT
from . import rpc
from .config import LabConfig
from .group import get, group_spec
from .healing_record import HealingRecords
from .lab_world import Healing, LabWorld
from .processes import LabProcesses
from .world import RankInfo

__all__ = ["Healer"]

class Healer:
    """What a lab that heals does beyond one that does not, on ``processes`` and ``world``."""

    def __init__(self, processes: LabProcesses, world: LabWorld, timeout: float, debug: bool) -> None:
        self._processes = processes
        self._world = world
        self._timeout = timeout
        self._debug = debug
        self.lighthouse: Lighthouse | None = None  # torchft's, in a lab that heals
        self.records = HealingRecords()
        # What lab.push gave every rank: a replacement is given it too.
        self._pushed: dict[str, Any] = {}

    def remember_push(self, names: dict[str, Any]) -> None:
        self._pushed.update(names)

    def forget_pushes(self) -> None:
        self._pushed = {}

    def start_lighthouse(self, config: LabConfig, phase: Callable[[str], None]) -> None:
        """torchft's lighthouse, on the address the ranks reach the controller at (loopback, or the
        switch's on emulated nodes), ended with the lab (or by its guard, if the notebook dies)."""
        processes = self._processes
        assert processes.folder is not None
        self.lighthouse = Lighthouse.start(
            processes.controller_ip(), processes.folder, self._timeout, processes.exec_prefix()
        )
        processes.guard.adopt(self.lighthouse.pid)
        if processes.network is None and config.launcher == "local" and warm.enabled():
            # A replacement rank is forked from the template: with torchft there, it starts with it.
            # In the background: the lab's own ranks are forked first.
            threading.Thread(target=_preload_healing, daemon=True, name="distlab-preload-torchft").start()
        phase("lighthouse_s")

    def stop_lighthouse(self) -> None:
        lighthouse, self.lighthouse = self.lighthouse, None
        if lighthouse is not None:
            lighthouse.stop()  # ended with the lab's process groups already: reaped here

    @property
    def healing(self) -> Healing:
        """What ranks are told where the lab heals: its lighthouse, and the file a healing cell's end is written to."""
        folder = self._processes.folder
        if self.lighthouse is None or folder is None:
            return ("", "")
        return (self.lighthouse.address, os.path.join(folder, "heal-end"))

    def replace_rank(self, rank: int, config: LabConfig) -> tuple[Any, RankInfo]:
        """A new engine in the place of rank ``rank``, which died while a healing cell ran: started
        (forked where ranks are warm) on the dead rank's node, told it is that rank, with everything
        but the process group (``rank.group.join_as_replacement``). Its engine view and table row."""
        world = self._world.current
        assert world is not None
        processes = self._processes
        old = world.table[rank]
        # A spare where the lab keeps them; else an engine started on the dead rank's node.
        node = world.hosts().index(old.host) if processes.network else None
        (engine_id,) = processes.gather_engines(1, config, self._world.engine_ids, node)
        client = processes.client
        (identity,) = get(rpc.describe(client.direct_view([engine_id]), processes.controller_ip()), self._timeout,
                          f"describing rank {rank}'s replacement")
        processes.spares.claim([identity["pid"]])
        processes.retired.add(old.engine_id)
        new = replace(old, engine_id=engine_id, pid=identity["pid"], addr=identity["addr"], health="ok")
        spec = group_spec(self._world.put(rank, new), new, 0, self._timeout, self._debug, self.healing)
        get(rpc.join_as_replacement(client[engine_id], spec), self._timeout, f"making rank {rank}'s replacement")
        view = client.direct_view([engine_id])
        view.use_cloudpickle().get(timeout=self._timeout)
        if self._pushed:
            get(view.push(self._pushed, block=False), self._timeout, f"pushing to rank {rank}'s replacement")
        processes.guard.adopt_engine_helpers([new.pid])
        return client[engine_id], new

    def replace_before(self, gone: list[int], config: LabConfig) -> None:
        """Ranks that died between cells (``%dist kill``) are started again before the next cell, and
        the whole group formed: they have none of the names earlier cells made."""
        for rank in gone:
            self.replace_rank(rank, config)
        self._world.form_whole(gone, self.healing)
        print(
            f"[distlab] rank {format_ranks(gone)} had died: a new process took its place before this cell "
            "(it has none of the names earlier cells made)", flush=True,
        )

    def whole_again(self, outcome: Any) -> None:
        """After a healing cell in which ranks were replaced: one process group of every rank again,
        for the next cell (a replacement joined the cell's quorum, never the old group), and notes
        that say what happened."""
        client = self._processes.client
        try:
            world = self._world.form_whole(list(outcome.replaced), self.healing)
            src = min(r.rank for r in world.table if r.rank not in outcome.replaced)
            shares = [rpc.share_state(client[r.engine_id], src) for r in world.table]
            same = {get(ar, self._timeout, "comparing the ranks' healed state") for ar in shares}
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
