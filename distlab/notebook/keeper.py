"""A kept lab's side of its lab (``keep=True``): its record written at start and restart and removed at
stop, letting go of the lab (``lab.detach()``), and taking it back (``distlab.attach()``).

What a record holds and where it is, and choosing one to attach, is ``kept``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from ..errors import LabUsageError
from .config import LabConfig
from .group import get
from .kept import read, record_path
from .lab_world import LabWorld
from .processes import LabProcesses
from .world import RankInfo, World

__all__ = ["Keeper"]


class Keeper:
    """A kept lab's record, for its ``processes`` and ``world``: written at start and restart, removed
    at stop; letting go of the lab, and taking it back."""

    def __init__(self, processes: LabProcesses, world: LabWorld, timeout: float) -> None:
        self._processes = processes
        self._world = world
        self._timeout = timeout

    def write(self, lab_id: str, config: LabConfig, **extra: Any) -> Path:
        """Record what another kernel needs to take the lab back; this process holds it (``owner``)."""
        cluster, world = self._processes.cluster, self._world.current
        assert world is not None
        record = {
            "id": lab_id,
            "cluster_id": cluster.cluster_id,
            "cluster_file": cluster.cluster_file,
            "owner": os.getpid(),
            "config": {f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
            "world": {"table": [dataclasses.asdict(r) for r in world.table], "backend": world.backend,
                      "master_addr": world.master_addr, "note": world.note},
            "started": extra.pop("started", time.time()),
            **extra,
        }
        path = record_path(record["cluster_id"])
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)  # whole, for the watchdog that reads it
        return path

    def remove(self) -> None:
        cluster = self._processes.cluster
        if cluster is not None:
            path = record_path(cluster.cluster_id)
            for each in (path, Path(f"{path}.gone")):
                with contextlib.suppress(OSError):
                    each.unlink()

    def let_go(self, lab_id: str, config: LabConfig) -> None:
        """Mark the record let go of (``detached``), and let go of the processes: they go on."""
        record = read(record_path(self._processes.cluster.cluster_id)) or {}
        self.write(lab_id, config, started=record.get("started", time.time()), detached=time.time())
        self._processes.let_go()
        self._world.clear()

    def take_back(self, record: dict[str, Any], lab_id: str, config: LabConfig) -> World:
        """Reconnect to a kept lab's controller and ranks, and hold it from this process: its world."""
        processes = self._processes
        processes.take_back(record["cluster_file"], record["id"], config.keep)
        table = tuple(RankInfo(**row) for row in record["world"]["table"])
        missing = sorted({r.engine_id for r in table} - processes.registered())
        if missing:
            raise LabUsageError(f"kept lab {record['id']} lost ranks (engines {missing}): stop it and start anew")
        world = World(table, record["world"]["backend"], record["world"]["master_addr"], record["world"]["note"])
        self._world.adopt(world)
        ids = [r.engine_id for r in table]
        # The ranks answer (within the deadline), and take names defined here by value, as at a start.
        get(processes.client.direct_view(ids).use_cloudpickle(), self._timeout, "reaching the kept ranks")
        processes.watch_taken_back(config.keep)
        processes.guard.adopt_engine_helpers(self._world.local_pids())
        # Ours now: the watchdog of the kernel that kept it sees another owner, and goes.
        self.write(lab_id, config, started=record.get("started", time.time()))
        return world
