"""torch.profiler on a rank for ``lab.profile``: armed before a cell, stopped at its end, read after.

The notebook arms the rank just before the profiled cell (:func:`start_profile`), the cell's end
stops the recording (a ``hooks.at_cell_end`` hook, before the reply: nothing after the cell is
recorded), and the notebook then reads what was recorded (:func:`profile_trace`).

A step is one ``optimizer.step()`` on the rank, seen through torch's public global hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``). Until the cell's first step the
profiler records everything, so that a cell with no optimizer at all is profiled whole. At the
first step that recording is dropped (the cell has steps, and its first one carries the set-up:
model construction, DDP's first broadcast) and torch's own schedule takes over:
``schedule(wait=0, warmup=warmup, active=steps, repeat=1)``, stepped by each later
``optimizer.step()``. A cell that ends before ``steps`` steps keeps what was recorded.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from ..wire import ProfileTrace
from . import hooks

if TYPE_CHECKING:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.utils.hooks import RemovableHandle
from .namespace import user_namespace

__all__ = ["profile_trace", "start_profile"]


@dataclass
class _Armed:
    steps: int
    warmup: int
    tid: int  # the native id of the thread that runs cells (the engine's main thread)
    profiler: torch.profiler.profile
    hook: RemovableHandle  # the optimizer hook's
    scheduled: bool = False  # the first optimizer step has come: torch's schedule drives the profiler
    optimizer_steps: int = 0


_armed: _Armed | None = None
_kept: tuple[torch.profiler.profile, _Armed] | None = None  # the stopped profiler and how it ran, until read


def start_profile(steps: int, warmup: int) -> None:
    """Arm the profiler for the next cell on this rank: recording starts now, the cell's end stops it."""
    global _armed, _kept
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _end_recording()  # a profile armed earlier and never read (its cell failed) goes
    _kept = None
    profiler = torch.profiler.profile(activities=_activities())
    with _kineto_quiet():
        profiler.start()
    hook = register_optimizer_step_post_hook(_on_optimizer_step)
    _armed = _Armed(steps, warmup, threading.get_native_id(), profiler, hook)


def profile_trace() -> ProfileTrace | None:
    """What the last profiled cell recorded on this rank, then forgotten; None if nothing is kept.

    torch.profiler exports it as Chrome-trace JSON (to a temporary file, its only way), which goes
    back compressed: a trace is mostly repeated keys and names.
    """
    global _kept
    _end_recording()
    if _kept is None:
        return None
    profiler, armed = _kept
    _kept = None
    fd, path = tempfile.mkstemp(prefix="distlab-profile-", suffix=".json")
    os.close(fd)
    try:
        profiler.export_chrome_trace(path)
        with open(path, "rb") as exported:
            data = exported.read()
    finally:
        os.unlink(path)
    counted = max(0, armed.optimizer_steps - 1 - armed.warmup)  # the first step ends the whole-cell recording
    return {
        "trace": zlib.compress(data, 6),
        "steps": min(armed.steps, counted) if armed.scheduled else 0,
        "whole": not armed.scheduled,
        "optimizer_steps": armed.optimizer_steps,
        "tid": armed.tid,
    }


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    armed = _armed
    if armed is None:
        return
    armed.optimizer_steps += 1
    if not armed.scheduled:
        import torch

        with _kineto_quiet():
            armed.profiler.stop()  # the whole-cell recording: not needed, the cell has steps
        with warnings.catch_warnings():
            # torch warns that warmup=0 may skew the first step: the user asked for it.
            warnings.simplefilter("ignore", UserWarning)
            schedule = torch.profiler.schedule(wait=0, warmup=armed.warmup, active=armed.steps, repeat=1)
        armed.profiler = torch.profiler.profile(activities=_activities(), schedule=schedule)
        armed.scheduled = True
        with _kineto_quiet():
            armed.profiler.start()
    elif armed.optimizer_steps <= 1 + armed.warmup + armed.steps:
        # Past the schedule's end each step would do nothing: they are left alone. The hook stays
        # registered until the cell ends (removing it here would change torch's hook table while
        # torch iterates over it).
        with _kineto_quiet():
            armed.profiler.step()


@hooks.at_cell_end
def _end_recording() -> None:
    """Stop the recording where the profiled cell ends, and keep it for :func:`profile_trace`."""
    global _armed, _kept
    armed = _armed
    if armed is None:
        return
    _armed = None
    armed.hook.remove()
    with _kineto_quiet():
        armed.profiler.stop()
    _kept = (armed.profiler, armed)


def _activities() -> list[ProfilerActivity]:
    """The CPU, and the rank's GPU where its device is one (never a CUDA context made for nothing)."""
    from torch.profiler import ProfilerActivity, supported_activities

    wanted = [ProfilerActivity.CPU]
    on_gpu = str(user_namespace().get("device", "cpu")).startswith("cuda")
    # torch leaves supported_activities unannotated: it returns a set of ProfilerActivity
    available = cast("Callable[[], set[ProfilerActivity]]", supported_activities)()
    if on_gpu and ProfilerActivity.CUDA in available:
        wanted.append(ProfilerActivity.CUDA)
    return wanted


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null while torch's profiler starts or stops.

    Kineto writes a line to the process's stderr at each start and stop (``USDT: ...
    profiler_start``), which the rank's output would show in the cell; its own switch for that
    (``KINETO_LOG_LEVEL``) is read once, when torch is imported. Python's ``sys.stderr`` (the
    cell's, a pipe of ipykernel's) is untouched: only what C++ writes in these moments is lost.
    """
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to keep quiet
        yield
        return
    quiet = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(quiet, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)
