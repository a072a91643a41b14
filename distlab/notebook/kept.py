"""Labs that outlive their kernel on purpose (``keep=True``, ``%dist start --keep``), and taking one back.

A lab is slow to get where ranks are expensive (a queue on a cluster, a model loaded on every rank),
and a kernel restart used to end it with everything its ranks held. A kept lab is not ended by its
kernel's end, clean or killed: its watchdog (``cluster.reaper``) spares it, and waits. Another kernel
of the same user on this machine takes it back with ``distlab.attach()`` (``%dist attach [LAB_ID]``):
the same ranks, with what their cells left in them (a model, an optimizer), and the process group
they formed. A kept lab nobody attaches ends once it has waited ``keep`` seconds (an hour with
``keep=True``), as a lab that is not kept ends with its kernel.

What a new kernel needs to take a lab back is in its record, ``<Jupyter runtime dir>/distlab/kept/
<cluster id>.json`` (this user's only): the lab's configuration, its rank table, ipyparallel's cluster
file (which ``ipyparallel.Cluster.from_file`` reconnects from) and the process that holds it now.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cluster.processes import pid_alive
from ..errors import LabUsageError
from . import labs

__all__ = ["KeepsItself", "attach", "folder", "kept_labs", "record_path", "remove", "write"]


def folder() -> Path:
    """Where kept labs' records are: this user's Jupyter runtime folder (``JUPYTER_RUNTIME_DIR``)."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "distlab" / "kept"


def record_path(cluster_id: str) -> Path:
    return folder() / f"{cluster_id}.json"


def write(lab: Any, **extra: Any) -> Path:
    """Record what another kernel needs to take ``lab`` back; this process holds it (``owner``)."""
    world = lab._world
    record = {
        "id": labs.id_of(lab),
        "cluster_id": lab._cluster.cluster_id,
        "cluster_file": lab._cluster.cluster_file,
        "owner": os.getpid(),
        "config": {f.name: getattr(lab.config, f.name) for f in dataclasses.fields(lab.config)},
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


def remove(lab: Any) -> None:
    if lab._cluster is not None:
        path = record_path(lab._cluster.cluster_id)
        for each in (path, Path(f"{path}.gone")):
            with contextlib.suppress(OSError):
                each.unlink()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def kept_labs() -> list[dict[str, Any]]:
    """The records of this user's kept labs still there (their cluster file too), oldest first;
    ``held`` says whether a live process holds each."""
    found = []
    for path in sorted(folder().glob("*.json")):
        record = _read(path)
        if record is None or not os.path.exists(record.get("cluster_file", "")):
            continue
        owner = int(record.get("owner", 0))
        record["held"] = owner != os.getpid() and pid_alive(owner) and not record.get("detached")
        with contextlib.suppress(OSError, ValueError):  # when its watchdog saw its kernel go
            record["gone"] = float(Path(f"{path}.gone").read_text())
        found.append(record)
    return sorted(found, key=lambda r: r.get("started", 0))


def _describe(record: dict[str, Any]) -> str:
    held = f", held by process {record['owner']}" if record["held"] else ""
    return f"{record['id']} ({len(record['world']['table'])} ranks{held})"


def _choose(lab_id: str | None) -> dict[str, Any]:
    records = kept_labs()
    if not records:
        raise LabUsageError(
            "no kept lab to attach here: start one with %dist start -n 2 --keep (distlab.start(2, keep=True)), "
            "which outlives its kernel"
        )
    if lab_id is None:
        free = [r for r in records if not r["held"]]
        if len(free) != 1:
            raise LabUsageError(
                f"{'no kept lab is free' if not free else f'{len(free)} kept labs are free'}: "
                f"name one, like %dist attach {records[0]['id']} (kept: {', '.join(map(_describe, records))})"
            )
        return free[0]
    chosen = next((r for r in records if lab_id in (r["id"], r["cluster_id"])), None)
    if chosen is None:
        raise LabUsageError(f"no kept lab {lab_id!r} here: kept are {', '.join(map(_describe, records))}")
    if chosen["held"]:
        raise LabUsageError(
            f"kept lab {chosen['id']} is held by process {chosen['owner']}, a kernel still running: "
            f"there, lab.detach() lets go of it (or stop that kernel)"
        )
    return chosen


def attach(lab_id: str | None = None, timeout: float | None = None) -> Any:
    """Take back a kept lab (the only free one, or ``lab_id``): its ranks, as their cells left them.

    The lab it gives is this kernel's, as if it had started it: it runs cells, stops, and is kept
    again when this kernel ends (``keep`` still holds)."""
    from .config import LabConfig
    from .lab import Lab

    record = _choose(lab_id)
    config = dict(record["config"])
    if timeout is not None:
        config["timeout"] = timeout
    lab: Any = Lab.from_config(LabConfig(**config))
    lab._take_back(record)
    return lab


class KeepsItself:
    """The part of a lab (``core.LabCore``) that a kept lab adds: letting go, and being taken back."""

    config: Any
    backend: str
    _cluster: Any
    _client: Any
    _world: Any
    _guard: Any
    _releaser: Any
    started_at: float | None
    last_cell_at: float | None

    if TYPE_CHECKING:  # what LabCore provides

        @property
        def timeout(self) -> float: ...
        def _connect_client(self) -> None: ...
        def _local_pids(self) -> list[int]: ...
        def _tell(self, event: str) -> None: ...

    def _keep_watch(self) -> tuple[float, str] | None:
        """What the watchdog needs to spare a kept lab when its kernel ends: (idle seconds, record)."""
        if not self.config.keep:
            return None
        self._cluster.shutdown_atexit = False  # ipyparallel's own exit handler would stop it
        return float(self.config.keep), str(record_path(self._cluster.cluster_id))

    def detach(self) -> None:
        """Let go of a kept lab: its ranks go on, for ``distlab.attach()`` in another kernel (this one
        no longer drives them). A kept lab is let go of so when its kernel ends."""
        if not self.config.keep:
            raise LabUsageError("only a kept lab can be let go of: start it with keep=True (%dist start --keep)")
        if self._cluster is None:
            return
        record = _read(record_path(self._cluster.cluster_id)) or {}
        write(self, started=record.get("started", time.time()), detached=time.time())
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        self._client, self._cluster, self._world = None, None, None
        # The watchdog stays: it ends the lab if nobody attaches it within its time.
        self._guard.release()
        labs.remove(self)  # type: ignore[arg-type]  # a LabCore: the mixin is one of its bases
        self._tell("stopped")

    def _take_back(self, record: dict[str, Any]) -> None:
        """Reconnect to a kept lab's controller and ranks, and hold it from this process."""
        import ipyparallel as ipp

        from ..cluster.launch import _ipp_log
        from .group import get
        from .world import RankInfo, World

        try:
            self._cluster = ipp.Cluster.from_file(record["cluster_file"], log=_ipp_log())
        except (OSError, ValueError, KeyError) as exc:
            raise LabUsageError(f"kept lab {record['id']} cannot be reached ({exc}): it has ended") from None
        labs.add(self)  # type: ignore[arg-type]
        try:
            self._connect_client()
            table = tuple(RankInfo(**row) for row in record["world"]["table"])
            missing = sorted({r.engine_id for r in table} - set(self._client.ids))
            if missing:
                raise LabUsageError(f"kept lab {record['id']} lost ranks (engines {missing}): stop it and start anew")
            self._world = World(table, record["world"]["backend"], record["world"]["master_addr"],
                                record["world"]["note"])
            self.backend = self._world.backend
            self._releaser.listen(self._client, table, self.timeout)
            ids = [r.engine_id for r in table]
            # The ranks answer (within the deadline), and take names defined here by value, as at a start.
            get(self._client.direct_view(ids).use_cloudpickle(), self.timeout, "reaching the kept ranks")
            self._guard.watch(self._cluster, keep=self._keep_watch())
            self._guard.adopt_engine_helpers(self._local_pids())
            # Ours now: the watchdog of the kernel that kept it sees another owner, and goes.
            write(self, started=record.get("started", time.time()))
            self.started_at, self.last_cell_at = record.get("started") or time.time(), None
        except BaseException:
            self._client, self._cluster, self._world = None, None, None
            labs.remove(self)  # type: ignore[arg-type]
            raise
        self._tell("started")
