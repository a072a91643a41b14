"""Where each running lab tells the Jupyter server about itself: one small JSON file per lab.

A Lab writes ``<jupyter runtime dir>/distlab/<lab id>.json`` (mode 0600, in a 0700 folder; the id
is ``lab-<pid>-<id(lab) in hex>``) when it starts or restarts, while a cell runs (from
``BUSY_AFTER_S`` on, at most every ``WRITE_EVERY_S``) and when a cell ends, and removes it on
stop. The file says which kernel the lab lives in (its connection file), the rank table and the
latest training rate.
``distlab.server.handlers`` reads these files for the side panel; files of processes that are gone
are removed by the reader.

The writing half is :class:`PanelFile`, an observer every ``Lab`` is given (``front.lab``); the
lab knows nothing of it. The side panel's Stop and Restart reach any running lab of the kernel's
process by its id (``act``, through ``notebook.labs``), however it was started: ``%dist start``
or ``distlab.start()``.

This module is imported by every Lab: it must stay light (no Jupyter server, no tornado), and
nothing in it may break a lab: every write swallows its errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from ..cluster.processes import machine_id
from ..cluster.processes import pid_alive as _pid_alive
from ..notebook import labs
from ..notebook.labs import id_of
from ..notebook.observers import ObservedLab, Observer

if TYPE_CHECKING:
    from ..ipycompat import IppAsyncResult
    from ..notebook.world import RankInfo
    from ..records import StepRecord

__all__ = [
    "ACTIONS", "BUSY_AFTER_S", "LAST_CELL_EVERY_S", "WRITE_EVERY_S", "PanelFile", "act", "forget", "id_of", "publish",
    "read_labs", "registry_dir", "track",
]

#: While a cell runs, the lab's file is rewritten at most this often.
WRITE_EVERY_S = 2.0
#: A cell's end is written into the file (``last_cell``, for the classroom's idle view) at most this
#: often when nothing else it says changed: a quick cell in a loop pays for one write in this long.
LAST_CELL_EVERY_S = 10.0
#: A cell shows its ranks busy once it has run this long: a quicker one (most cells) writes
#: nothing, where a write (~1-8 ms, ``os.replace`` included) would be a fifth of an empty cell.
BUSY_AFTER_S = 0.5
_FORMAT = 1
# Steps of rank 0 the step rate is measured over.
_RATE_WINDOW = 10

class RankRow(TypedDict):
    """A rank of a lab's file: its row of the rank table."""

    rank: int
    engine_id: int
    host: str
    addr: str
    pid: int
    device: str
    health: str  # "ok", "busy", ...; "dead" when the reader finds its process gone
    machine: str


class TrainingSummary(TypedDict):
    """The latest step, steps per second and all-reduce seconds per step; None where unknown."""

    step: int | None
    steps_per_s: float | None
    allreduce_s: float | None


class PausedSummary(TypedDict):
    """A cell held at a breakpoint (``lab.paused``), as the side panel shows it."""

    index: int
    op: str
    group: str
    line: int | None
    disagree: list[int]


class LabState(TypedDict):
    """What a lab's file says (format 1)."""

    format: int
    pid: int
    connection_file: str | None  # the kernel's (None outside a kernel)
    updated: float
    started: float | None  # seconds since the epoch
    last_cell: float | None
    world_size: int
    backend: str
    launcher: str
    nodes: int | None  # emulated nodes, and the link between them (None: not shaped)
    link: str | None
    racks: list[list[int]]  # the ranks of each rack, and each rack's uplink (None: not shaped)
    uplink: str | None
    busy: bool
    every_cell: bool
    paused: PausedSummary | None
    ranks: list[RankRow]
    training: TrainingSummary


class LabEntry(LabState):
    """A lab's file as :func:`read_labs` gives it, with its ``id`` (the file's name)."""

    id: str


#: What the side panel may do to a lab (``act``): step and continue a cell paused at a breakpoint.
ACTIONS = ("stop", "restart", "step", "continue")

# lab -> (when its file was last written, what it said: busy ranks, telemetry version, rank pids)
_last_write: weakref.WeakKeyDictionary[Any, tuple[float, object]] = weakref.WeakKeyDictionary()
_listening: weakref.WeakSet[Any] = weakref.WeakSet()  # labs whose cells already update their file
_cell_since: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()  # lab -> its cell's first poll


def registry_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "distlab"


class PanelFile(Observer):
    """A lab's observer: its state file, written at start, restart and a change of link, kept
    current while cells run, and removed at stop."""

    def started(self, lab: ObservedLab) -> None:
        track(lab)

    def restarted(self, lab: ObservedLab) -> None:
        publish(lab)

    def changed(self, lab: ObservedLab) -> None:
        publish(lab)

    def stopped(self, lab: ObservedLab) -> None:
        forget(lab)

    @contextlib.contextmanager
    def cell(self, lab: ObservedLab, stream: bool) -> Iterator[None]:
        try:
            yield
        finally:  # after the lab noted the cell's end (``last_cell``), which the final poll precedes
            _cell_since.pop(lab, None)
            publish(lab, busy=set(), ask=False)  # written only if the cell changed what it says


def _path(lab: Any) -> Path:
    return registry_dir() / f"{id_of(lab)}.json"


# ---------------------------------------------------------------------------- writing (in the kernel)


def track(lab: Any) -> None:
    """A lab has started: write its file now and keep it current while cells run.

    The Lab feeds its telemetry store before any listener added here, so ``on_poll`` reads the
    poll's own data (not the previous poll's) without touching ``lab.telemetry`` first."""
    if lab not in _listening:  # a lab started again after a stop keeps its one listener
        _listening.add(lab)

        def on_poll(pending: dict[int, IppAsyncResult], final: bool) -> None:
            now = time.monotonic()
            if final:
                return  # the file is written once the cell's end is known (``PanelFile.cell``)
            since = _cell_since.setdefault(lab, now)
            if now - since >= BUSY_AFTER_S and now - _last_write.get(lab, (0.0, None))[0] >= WRITE_EVERY_S:
                publish(lab, busy={rank for rank, ar in pending.items() if not ar.ready()}, ask=False)

        lab.add_listener(on_poll)
    with contextlib.suppress(Exception):  # tidying other kernels' stale files: never stops this lab's publish
        read_labs()  # which removes the files of kernels killed before they could
    publish(lab)


def publish(lab: Any, busy: set[int] | None = None, ask: bool = True) -> None:
    """Write the lab's file. ``busy``: ranks running a cell now. ``ask``: ask the controller for
    each rank's health (a round trip); else the table's, and the reader marks ranks whose process
    is gone. Cells call this with ``ask=False`` and skip the write when nothing changed, so a
    quick cell pays microseconds for it."""
    try:
        state = (frozenset(busy or ()), lab.telemetry.version, tuple(r.pid for r in lab.table),
                 (lab.last_cell_at or 0.0) // LAST_CELL_EVERY_S)
        if not ask and _last_write.get(lab, (0.0, None))[1] == state:
            return
        _last_write[lab] = (time.monotonic(), state)
        _write(_path(lab), _describe(lab, busy, ask))
    except Exception:  # noqa: BLE001, S110 - the side panel is a convenience; the lab must go on
        pass


def forget(lab: Any) -> None:
    """The lab has stopped: remove its file."""
    _last_write.pop(lab, None)
    with contextlib.suppress(OSError):
        _path(lab).unlink()


def act(lab_id: str, action: str) -> str:
    """Stop or restart the running lab ``lab_id`` of this process (the side panel's buttons, sent
    by the server into this kernel); one line saying what was done. An unknown action
    (ValueError) or lab (LookupError) raises one line saying what is wrong, and changes nothing."""
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r} for a lab: use one of {', '.join(ACTIONS)}")
    lab = labs.get(lab_id)
    if lab is None or not lab.running:
        known = ", ".join(sorted(id_of(lab) for lab in labs.running())) or "none"
        raise LookupError(f"no running lab {lab_id!r} in process {os.getpid()} (its running labs: {known})")
    if action == "stop":
        lab.stop()
        return "lab stopped: engines and controller are gone"
    if action in ("step", "continue"):
        if lab.paused is None:
            raise ValueError(f"nothing is paused in lab {lab_id!r}: lab.pause(at=3) arms the next cell")
        if action == "continue":
            lab.cont()
            return "the cell ran to its end"
        pause = lab.step()
        return "the cell ended" if pause is None else f"paused before collective {pause.index} ({pause.op})"
    t0 = time.perf_counter()
    lab.restart()
    n = lab.world_size
    return f"{n} fresh rank{'s' if n != 1 else ''} ready in {time.perf_counter() - t0:.1f} s"


def _describe(lab: Any, busy: set[int] | None, ask: bool) -> LabState:
    busy = busy or set()
    if ask:
        try:
            table = list(lab.status())  # health asked of the controller now
        except Exception:  # noqa: BLE001 - a lab that cannot answer is reported as such
            table = [replace(r, health="unknown") for r in lab.table]
    else:
        table = list(lab.table)
    rows: list[RankRow] = [{**_row(r), "health": "busy" if r.rank in busy else r.health} for r in table]
    return {
        "format": _FORMAT,
        "pid": os.getpid(),
        "connection_file": _connection_file(),
        "updated": time.time(),
        # Seconds since the epoch (None: no cell yet): the classroom's view shows "started" and "idle".
        "started": lab.started_at,
        "last_cell": lab.last_cell_at,
        "world_size": lab.world_size,
        "backend": lab.backend,
        "launcher": lab.launcher,
        # On emulated nodes: how many, and the link between them (None: not shaped).
        "nodes": lab.config.nodes,
        "link": str(lab.link) if lab.link is not None else None,
        # In racks: the ranks of each rack, and each rack's uplink to the spine (None: not shaped).
        "racks": lab.racks,
        "uplink": str(lab.uplink) if lab.uplink is not None else None,
        "busy": bool(busy),
        # %dist auto on: the notebook runs every plain cell on these ranks.
        "every_cell": lab.every_cell,
        "paused": _paused(lab),
        "ranks": rows,
        "training": training_summary(lab.telemetry.records()),
    }


def _paused(lab: Any) -> PausedSummary | None:
    pause = getattr(lab, "paused", None)  # a lab of another kind (a companion) has no breakpoints
    if pause is None:
        return None
    return {"index": pause.index, "op": pause.op, "group": pause.group, "line": pause.rows[0].line,
            "disagree": pause.disagree}


def _row(r: RankInfo) -> RankRow:
    return {
        "rank": r.rank, "engine_id": r.engine_id, "host": r.host, "addr": r.addr, "pid": r.pid,
        "device": r.device, "health": r.health, "machine": r.machine,
    }


def training_summary(records: list[StepRecord]) -> TrainingSummary:
    """The latest step, steps per second (rank 0, last few steps) and all-reduce seconds per step
    (the latest step's buckets, averaged over the ranks that recorded it); None where unknown."""
    if not records:
        return {"step": None, "steps_per_s": None, "allreduce_s": None}
    last_step = max(rec["step"] for rec in records)
    latest = [rec for rec in records if rec["step"] == last_step]
    first_rank = min(rec["rank"] for rec in records)
    mine = [rec for rec in records if rec["rank"] == first_rank][-_RATE_WINDOW:]
    rate = None
    if len(mine) >= 2 and mine[-1]["t"] > mine[0]["t"]:
        rate = (mine[-1]["step"] - mine[0]["step"]) / (mine[-1]["t"] - mine[0]["t"])
    elif mine and mine[-1].get("step_time_s"):
        rate = 1.0 / (mine[-1]["step_time_s"] + (mine[-1].get("idle_s") or 0.0))
    timed = [rec for rec in latest if rec.get("allreduce")]
    allreduce = (
        sum(sum(b["seconds"] for b in rec["allreduce"]) for rec in timed) / len(timed) if timed else None
    )
    return {"step": last_step, "steps_per_s": rate, "allreduce_s": allreduce}


def _connection_file() -> str | None:
    """The kernel's connection file, or None outside a Jupyter kernel (a script, a test)."""
    if "ipykernel.kernelapp" not in sys.modules:  # not in a kernel; do not import one
        return None
    from ipykernel.connect import get_connection_file

    try:
        return os.path.realpath(get_connection_file())
    except RuntimeError:  # ipykernel imported, but this process is not a kernel
        return None


def _write(path: Path, data: LabState) -> None:
    _private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")  # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _private_dir(folder: Path) -> None:
    """The folder, made 0700 if new; one that exists is made 0700 too when it is ours (mkdir's mode
    applies only to a folder it creates), and refused when it is another user's."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"{folder} belongs to another user: the labs' state files are not written there")
    if info.st_mode & 0o077:
        folder.chmod(0o700)


# ---------------------------------------------------------------------------- reading (in the server)


def read_labs(directory: Path | None = None) -> list[LabEntry]:
    """Every live lab's description. Files of dead processes (or of kernels whose connection file
    is gone) are removed; ranks on this host whose process is gone are reported dead."""
    directory = directory or registry_dir()
    here = machine_id()
    labs = []
    for path in sorted(directory.glob("lab-*.json")):
        try:
            data: LabEntry = json.loads(path.read_text())  # written by _describe, "id" set below
            pid = int(data["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not ours
        connection_file = data.get("connection_file")
        if not _pid_alive(pid) or (connection_file and not os.path.exists(connection_file)):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        for row in data.get("ranks") or ():
            if row.get("machine") == here and not _pid_alive(int(row.get("pid", 0))):
                row["health"] = "dead"
        data["id"] = path.stem
        labs.append(data)
    return labs

