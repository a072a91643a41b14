"""Breakpoints on collectives: every rank stops just before a chosen collective of the next cell.

The notebook arms a breakpoint (:func:`arm`, through ``lab.pause``); the next cell on this rank runs
under a dispatch mode that counts the collectives it launches, whoever launches them: DDP's buckets
from C++, FSDP2's all-gathers and reduce-scatters, DTensor's functional collectives, sends and
receives all reach the dispatcher (``rank.collective_ops``). At the chosen one the rank stops before
launching it, in its main thread, and waits for the notebook's word on ipyparallel's control
channel, which ipykernel serves from its control thread while the main thread waits (as
``rank.release`` does): what it is paused at, step (launch it, stop before the next collective),
continue (run to the cell's end), read a name of the cell's frame. A pause that hears nothing for
its deadline lets the cell go on, and says so in the cell's output. A breakpoint arms one cell.
"""

from __future__ import annotations

import base64
import contextlib
import linecache
import pickle
import queue
import sys
import threading
import time
import types
import zlib
from collections.abc import Iterator
from typing import cast

import torch
import torch.distributed as dist

from .. import ipycompat_engine
from ..wire import PAUSE_REPLY, PAUSE_REQUEST, Breakpoint, PausedAt, TensorSeen
from . import torchcompat_dispatch
from .collective_ops import collective_name, sent_tensors, subclass_dispatches
from .hooks import at_cell_end

__all__ = ["arm", "armed", "serve"]


_armed: Breakpoint | None = None
_paused: PausedAt | None = None
_seq = 0
_commands: queue.Queue[tuple[str, str, _Answer | None]] = queue.Queue()


def arm(spec: Breakpoint) -> None:
    """Stop the next cell on this rank before the collective ``spec`` names (the notebook's ``lab.pause``)."""
    global _armed
    serve()
    _armed = spec


def serve() -> bool:
    """Answer the notebook's pause requests on this engine's control channel."""
    return ipycompat_engine.serve_control_request(PAUSE_REQUEST, PAUSE_REPLY, _answer)


@contextlib.contextmanager
def armed(filename: str) -> Iterator[None]:
    """Around a cell's code (``rank.cell``): the breakpoint armed for it, if any, stops it."""
    global _armed
    spec, _armed = _armed, None
    if spec is None:
        yield
        return
    stops = _Stops(spec, filename)
    torchcompat_dispatch.push_dispatch_mode(stops)
    try:
        yield
    finally:
        stops.off = True
        torchcompat_dispatch.remove_dispatch_mode(stops)
        if not stops.reached:
            groups = ", ".join(sorted(stops.groups)) or "none"
            print(f"[distlab] the breakpoint at {spec.says()} was not reached: this cell ran {stops.count} "
                  f"collective{'' if stops.count == 1 else 's'} (groups: {groups})", flush=True)


class _Answer:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.content: dict[str, object] = {}


def _answer(request: dict[str, object]) -> dict[str, object]:
    """A pause request, in the control thread: ``state``, ``step``, ``cont`` or ``read``."""
    do, paused = request.get("do"), _paused
    if do == "state":
        return {"paused": paused}
    if paused is None or request.get("seq") not in (None, paused["seq"]):
        return {"error": "this rank is not paused there"}
    if do in ("step", "cont"):
        _commands.put((str(do), "", None))
        return {"ok": True}
    if do == "read":
        answer = _Answer()
        _commands.put(("read", str(request.get("name", "")), answer))
        if not answer.done.wait(10.0):
            return {"error": "the rank did not answer within 10 s"}
        return answer.content
    return {"error": f"no such pause request: {do!r}"}


class _Stops(torchcompat_dispatch.DispatchMode):
    """The dispatch mode of an armed cell: counts its collectives, stops before the chosen one and,
    once stepping, before each next one."""

    def __init__(self, spec: Breakpoint, filename: str) -> None:
        cast("types.FunctionType", super().__init__)()  # TorchDispatchMode's, unannotated in torch
        self.spec = spec
        self.filename = filename
        self.count = 0  # collectives launched by the cell so far
        self.matched = 0  # of them, those that match the breakpoint
        self.stepping = False
        self.off = False
        self.reached = False
        self.groups: set[str] = set()
        self._names: dict[torchcompat_dispatch.Op, str | None] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # as the telemetry's observer: torch.compile compiles with the mode on

    def __torch_dispatch__(
        self, func: torchcompat_dispatch.Op, types: tuple[type, ...], args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        if any(subclass_dispatches(t) for t in types):
            return NotImplemented  # a DTensor runs its op; its collectives come back here one by one
        kwargs = kwargs or {}
        if not self.off:
            name = self._names.get(func, "")
            if name == "":
                name = self._names[func] = _collective(func)
            if name is not None:
                self.count += 1
                self._consider(name, func, args, kwargs)
        return func(*args, **kwargs)

    def _consider(self, name: str, func: torchcompat_dispatch.Op, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> None:
        group = torchcompat_dispatch.collective_group(func, args, kwargs)
        group_name = _group_name(group)
        self.groups.add(group_name)
        spec = self.spec
        if not self.stepping:
            if (spec.op is not None and name != spec.op) or (spec.group is not None and group_name != spec.group):
                return
            if spec.line is not None and _cell_frame(self.filename)[1] != spec.line:
                return
            self.matched += 1
            if self.matched != spec.at:
                return
        self.reached = True
        frame, line = _cell_frame(self.filename)
        global _paused, _seq
        _seq += 1
        _paused = {
            "seq": _seq, "index": self.count, "op": name, "group": group_name,
            "group_ranks": _group_ranks(group), "line": line,
            "source": linecache.getline(self.filename, line).strip() if line else "",
            "tensors": [_seen(t) for t in sent_tensors(func, args)[:8]],
        }
        try:
            self._wait(frame)
        finally:
            _paused = None

    def _wait(self, frame: types.FrameType | None) -> None:
        """Wait in the main thread for the notebook's word; read names of ``frame`` meanwhile."""
        while not _commands.empty():  # words meant for an earlier pause
            _commands.get_nowait()
        deadline = time.monotonic() + self.spec.deadline_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.off = True
                print(f"[distlab] the pause ended at its {self.spec.deadline_s:g} s deadline with no word from "
                      "the notebook: the cell went on", flush=True)
                return
            try:
                do, name, answer = _commands.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if do == "step":
                self.stepping = True
                return
            if do == "cont":
                self.off = True
                return
            if do == "read" and answer is not None:
                answer.content = _read(frame, name)
                answer.done.set()


def _collective(func: torchcompat_dispatch.Op) -> str | None:
    name = collective_name(func)
    if name is None and func.namespace == "c10d" and torchcompat_dispatch.op_name(func) == "barrier":
        return "barrier"
    return name


def _group_name(group: dist.ProcessGroup | None) -> str:
    """How torch describes a group: ``default_pg``, ``mesh_tp`` for a DeviceMesh dimension, else its name."""
    if group is None:
        return "default_pg"
    desc = getattr(group, "group_desc", "") or ""
    return str(desc) if desc and desc != "undefined" else str(getattr(group, "group_name", "") or "?")


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    with contextlib.suppress(Exception):  # a group torch cannot list: its ranks are not shown
        return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    return []


def _cell_frame(filename: str) -> tuple[types.FrameType | None, int | None]:
    """The innermost frame of the cell's own code, and its line: where the collective was launched."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == filename:
            return frame, frame.f_lineno
        frame = frame.f_back
    return None, None


def _seen(tensor: torch.Tensor) -> TensorSeen:
    """A tensor as a table shows it: shape, dtype, norm, and a hash of its bytes (equal data, equal hash)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    norm = float(t.double().norm()) if t.numel() and not t.is_complex() else float(t.abs().double().norm())
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "norm": norm,
            "hash": f"{zlib.crc32(data):08x}"}


def _read(frame: types.FrameType | None, name: str) -> dict[str, object]:
    """The value of ``name`` in the paused cell's frame (its locals, then the rank's names), pickled."""
    if frame is None:
        return {"error": "the pause is outside the cell's code"}
    if not name.isidentifier():
        return {"error": f"read takes a name, like 'loss' (got {name!r})"}
    scope = {**frame.f_globals, **frame.f_locals}
    if name not in scope:
        return {"error": f"name {name!r} is not defined where the rank is paused"}
    try:
        data = pickle.dumps(scope[name])
    except Exception as exc:  # noqa: BLE001 - anything pickle refuses: said, and the pause goes on
        return {"error": f"{name} cannot be sent to the notebook: {type(exc).__name__}: {exc}"}
    return {"value": base64.b64encode(data).decode("ascii")}


@at_cell_end
def _forget() -> None:
    """A breakpoint armed for a cell that never ran its code (it failed to parse) arms no later one."""
    global _armed
    _armed = None
