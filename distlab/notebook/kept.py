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

``keeper.Keeper``, a lab's collaborator, writes and removes its record, lets go of it and takes it
back; :func:`attach` is given the factory that makes the lab to take it back into (``lab.attach``
gives ``Lab``'s), so that this module imports no lab.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..cluster.processes import pid_alive
from ..errors import LabUsageError
from .config import LabConfig

__all__ = ["TakesBack", "attach", "folder", "kept_labs", "read", "record_path"]


def folder() -> Path:
    """Where kept labs' records are: this user's Jupyter runtime folder (``JUPYTER_RUNTIME_DIR``)."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "distlab" / "kept"


def record_path(cluster_id: str) -> Path:
    return folder() / f"{cluster_id}.json"


def read(path: Path) -> dict[str, Any] | None:
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
        record = read(path)
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


class TakesBack(Protocol):
    """A lab a kept lab is taken back into (``core.LabCore.take_back``)."""

    def take_back(self, record: dict[str, Any]) -> None: ...


def attach(
    lab_id: str | None = None, timeout: float | None = None, *, factory: Callable[[LabConfig], TakesBack]
) -> Any:
    """Take back a kept lab (the only free one, or ``lab_id``) into the lab ``factory`` makes of its
    configuration: its ranks, as their cells left them.

    The lab it gives is this kernel's, as if it had started it: it runs cells, stops, and is kept
    again when this kernel ends (``keep`` still holds)."""
    record = _choose(lab_id)
    config = dict(record["config"])
    if timeout is not None:
        config["timeout"] = timeout
    lab = factory(LabConfig(**config))
    lab.take_back(record)
    return lab
