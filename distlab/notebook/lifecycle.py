"""How a lab starts, restarts, stops, lets go of its ranks and takes them back: in which order its
collaborators are asked, and when its views are told.

:class:`Lifecycle` is built by ``core.LabCore`` with the collaborators it orders; each of its methods
is the body of the ``LabCore`` method of its name, called with the lab's lock held. What it decides
of the lab itself (the backend, its note) it returns, as the world it formed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..cluster.gpus import local_gpus
from ..cluster.processes import signal_all
from . import labs
from .cells import CellRunner
from .config import LabConfig
from .healing import Healer
from .keeper import Keeper
from .lab_world import LabWorld
from .observers import ObserverBus
from .processes import LabProcesses
from .script import Restarted
from .world import RankTable, World, check_gpus

__all__ = ["Lifecycle", "Phases"]


class Phases:
    """How long each phase of a start or restart took, into ``timings`` (start-up is measured phase by phase)."""

    def __init__(self, timings: dict[str, float]) -> None:
        self._timings = timings
        self.began = self._last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self._timings[name] = now - self._last
        self._last = now

    def total(self, name: str) -> None:
        self._timings[name] = time.perf_counter() - self.began


class Lifecycle:
    """The order of a lab's start, restart and stop. ``owner`` is the lab (the registry's entry, what
    views are told about); ``on_failure()`` stops it, companions and all, when a start or restart fails."""

    def __init__(
        self, owner: labs.RegisteredLab, processes: LabProcesses, world: LabWorld, healer: Healer, keeper: Keeper,
        cells: CellRunner, bus: ObserverBus, on_failure: Callable[[], None],
    ) -> None:
        self._owner = owner
        self._processes = processes
        self._world = world
        self._healer = healer
        self._keeper = keeper
        self._cells = cells
        self._bus = bus
        self._on_failure = on_failure

    def start(self, config: LabConfig, timings: dict[str, float], adopt: Callable[[World], None]) -> World:
        """Start the controller and engines, build the rank table, initialise the process group.
        ``adopt(world)`` runs before the observers are told: what they read of the lab (its backend)
        is the new world's."""
        if config.launcher == "local":
            check_gpus(config.ranks, config.backend, _local_gpus(config.backend))
        phase = Phases(timings)
        labs.add(self._owner)  # stopped at the interpreter's exit, if still running
        self._cells.reset()
        self._healer.forget_pushes()
        try:
            self._processes.start(config, phase)
            if config.heal:
                self._healer.start_lighthouse(config, phase)
            ids = self._processes.gather_engines(config.ranks, config, frozenset())
            phase("engines_s")
            world = self._world.build(ids, config, self._healer.healing, phase)
            if config.keep:
                self._keeper.write(labs.id_of(self._owner), config)
        except BaseException:
            self._on_failure()
            raise
        phase.total("ready_s")
        self._processes.top_up_spares(config)
        adopt(world)
        self._bus.tell("started")
        return world

    def check_restart(self, config: LabConfig, ranks: int, backend: str) -> LabConfig:
        """The configuration of a restart at ``ranks`` (checked as the lab's own is), refused first if
        this machine lacks the GPUs."""
        new = replace(config, ranks=ranks)
        if new.launcher == "local":
            check_gpus(ranks, backend, _local_gpus(backend))
        return new

    def restart(self, config: LabConfig, timings: dict[str, float], adopt: Callable[[World], None]) -> World:
        """A fresh world of ``config.ranks`` ranks: new engine processes, ranks numbered the same way."""
        processes, world = self._processes, self._world
        phase = Phases(timings)
        old_ids = world.engine_ids
        old_pids = world.local_pids()
        # Ranks on other machines are ended by their launcher: their engine sets are stopped.
        elsewhere = len(old_pids) < len(world.table)
        old_sets = processes.rank_engine_sets() if elsewhere else []
        # The old world exits (each rank as it would on its own: buffers flushed, exit handlers run)
        # while the new one forms, on spares where the lab keeps them (else on engines started now);
        # the restart returns once the new world works, and the old one's end is seen to in the
        # background (its engine sets are ipyparallel's until the lab stops).
        signal_all(old_pids, signal.SIGTERM)
        processes.guard.end_engines_soon(old_pids)
        processes.retired |= old_ids
        world.clear()
        self._healer.forget_pushes()
        try:
            new = world.build(processes.gather_engines(config.ranks, config, frozenset()), config,
                              self._healer.healing, phase)
            for engine_set in old_sets:
                processes.cluster.stop_engines_sync(engine_set)
            if config.keep:
                self._keeper.write(labs.id_of(self._owner), config)
        except BaseException:
            self._on_failure()
            raise
        phase.total("restart_s")
        processes.top_up_spares(config)
        self._cells.new_world(Restarted(config.ranks))
        adopt(new)
        self._bus.tell("restarted")
        return new

    def stop(self, config: LabConfig) -> None:
        """Stop the lab's own processes (its companions have stopped) and make sure they are gone."""
        if config.keep:
            self._keeper.remove()
        self._healer.stop_watching()  # the lighthouse dies with the lab's groups below: not to be started again
        processes = self._processes
        if not processes.running:
            processes.stop([])  # a start that failed before its cluster existed: its network and folder
            labs.remove(self._owner)
            return
        processes.stop(self._world.local_pids())
        self._healer.stop_lighthouse()
        self._world.clear()
        processes.finish_stop()  # last: the watchdog covers everything above if the notebook dies mid-stop
        labs.remove(self._owner)
        self._bus.tell("stopped")

    def detach(self, config: LabConfig) -> None:
        """Let go of a kept lab; the watchdog stays: it ends the lab if nobody attaches it in time."""
        self._healer.stop_watching()
        self._keeper.let_go(labs.id_of(self._owner), config)
        labs.remove(self._owner)
        self._bus.tell("stopped")

    def take_back(self, record: dict[str, Any], config: LabConfig, adopt: Callable[[World], None]) -> World:
        """Reconnect to a kept lab's controller and ranks, and hold it from this process."""
        labs.add(self._owner)
        try:
            world = self._keeper.take_back(record, labs.id_of(self._owner), config)
            self._cells.reset()
        except BaseException:
            self._processes.forget()
            self._world.clear()
            labs.remove(self._owner)
            raise
        adopt(world)
        self._bus.tell("started")
        return world

    def status(self, caption: str) -> RankTable:
        """The rank table, each rank's health checked now: ok, busy or dead."""
        processes = self._processes
        registered = processes.registered()
        table = self._world.table
        alive = [r.engine_id for r in table if r.engine_id in registered]
        queue = processes.client.queue_status(targets=alive) if alive else {}
        rows = RankTable(caption=caption)
        for r in table:
            if not processes.alive(r, registered):
                health = "dead"
            elif isinstance(queue.get(r.engine_id), dict) and queue[r.engine_id].get("tasks"):
                health = "busy"
            else:
                health = "ok"
            rows.append(replace(r, health=health))
        return rows


def _local_gpus(backend: str) -> int | None:
    # Only NCCL needs them; counted from the driver, never by torch (cluster/gpus.py says why).
    return local_gpus() if backend == "nccl" else 0
