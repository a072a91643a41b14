"""A lab that heals (``heal=True``): torchft's lighthouse beside the ranks, a new process in a dead
rank's place, one whole group again after a healing cell, and the record of what the last one did.

- ``cluster.lighthouse``: the lighthouse process;  ``rank.heal``: the quorum on each rank;
- ``cell.CellRun`` asks for a replacement (:meth:`Healer.replace_rank`) when a rank dies while a cell
  runs; ``cells.CellRunner`` asks for one before a cell (:meth:`Healer.replace_before`) and for the
  whole group after it (:meth:`Healer.whole_again`);
- ``healing_record``: the quorums and heals the ranks published, folded (``HealingRecords``, the
  healer's ``records``, keeps the last cell's: ``lab.heals()``).

The lighthouse is the one process every quorum needs. A watcher starts it again on the same address
the moment it dies (its state is soft: the replicas it hears from); each rank's quorum in flight was
lost with it and fails at torchft's quorum timeout, which ``rank.heal`` turns into a step that does not
commit, so the cell goes on. The cell's notes say so (:meth:`Healer.lighthouse_notes`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..cluster import warm
from ..cluster.lighthouse import Lighthouse
from ..errors import DistlabError, RankError, format_ranks
from ..wire import HEALING_MODULES, HEALING_QUORUM_TIMEOUT_S, HEALING_RANK_ENVIRONMENT
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
        self._lighthouse_lock = threading.Lock()  # the watcher's restart against the lab's stop
        self._stop_watcher = threading.Event()  # set to end the running watcher; each start makes its own
        #: What the watcher did since the last cell's notes were taken (``lighthouse_notes``).
        self._lighthouse_events: list[str] = []
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
        self._stop_watcher = stop = threading.Event()
        threading.Thread(target=self._watch_lighthouse, args=(stop,), daemon=True, name="distlab-lighthouse").start()
        if processes.network is None and config.launcher == "local" and warm.enabled():
            # A replacement rank is forked from the template: with torchft there, it starts with it.
            # In the background: the lab's own ranks are forked first.
            threading.Thread(target=_preload_healing, daemon=True, name="distlab-preload-torchft").start()
        phase("lighthouse_s")

    def stop_watching(self) -> None:
        """From now on a lighthouse that dies stays dead (the lab is stopping, or let go)."""
        self._stop_watcher.set()
        with self._lighthouse_lock:  # a restart under way ends first
            pass

    def stop_lighthouse(self) -> None:
        self.stop_watching()
        with self._lighthouse_lock:
            lighthouse, self.lighthouse = self.lighthouse, None
        if lighthouse is not None:
            lighthouse.stop()  # ended with the lab's process groups already: reaped here

    def _watch_lighthouse(self, stop: threading.Event) -> None:
        """Start the lighthouse again on its address whenever it dies, until ``stop`` is set. It waits
        on the process itself (no polling): the lab's stop sets ``stop`` before it ends the lighthouse,
        so this thread lives exactly as long as the lighthouses it watches."""
        while (old := self.lighthouse) is not None:
            old.proc.wait()
            with self._lighthouse_lock:
                if stop.is_set() or self.lighthouse is not old:
                    return
                died_at = time.monotonic()
                code = old.proc.returncode
                how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                guard = self._processes.guard
                guard.disown(old.pid)
                try:
                    self.lighthouse = old.again(self._timeout)
                except DistlabError as exc:
                    self.lighthouse = None
                    self._lighthouse_events.append(
                        f"torchft's lighthouse died ({how}) and could not be started again ({exc}): "
                        "no quorum can form; %dist restart (lab.restart()) starts the lab again"
                    )
                    return
                guard.adopt(self.lighthouse.pid)
                self._lighthouse_events.append(
                    f"torchft's lighthouse died ({how}); distlab started it again on the same address in "
                    f"{time.monotonic() - died_at:.1f} s. A quorum the ranks were waiting for died with it: that "
                    f"step fails at torchft's quorum timeout ({HEALING_QUORUM_TIMEOUT_S:g} s) and does not commit, "
                    "and the next step's quorum forms on the new lighthouse"
                )

    def lighthouse_notes(self) -> list[str]:
        """What happened to the lighthouse since the last call (a cell's notes)."""
        with self._lighthouse_lock:
            notes, self._lighthouse_events = self._lighthouse_events, []
        return notes

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
        one = len(outcome.replaced) == 1
        it_was = "it was" if one else "they were"
        if same == {True}:
            how = "healed from a live peer and went on with the others, who did not stop; the replicas are identical"
        elif same == {False}:
            how = f"came after the others had ended the cell: {it_was} given rank {src}'s state at the end"
        else:
            how = "made no healing in the cell (distlab.heal) to compare"
        who = f"rank {ranks} died; its replacement ran" if one else f"ranks {ranks} died; their replacements ran"
        outcome.notes.append(f"{who} the cell {seconds:.1f} s later, {how}")


def _preload_healing() -> None:
    with contextlib.suppress(Exception):  # without it a replacement imports torchft itself (slower, as good)
        warm.current(os.environ).preload(HEALING_MODULES, HEALING_RANK_ENVIRONMENT)
