"""Every all-reduce bucket timed, through a DDP communication hook that keeps torch's own result.

The hook wraps ``default_hooks.allreduce_hook`` (torch documents it as giving the same result as no
hook at all) and only adds a timestamp before the call and one in the future's ``then`` callback.

DDP takes one hook per reducer and has no call to remove it. Closing a watch therefore gives the
model a fresh reducer (what DDP itself does when it is unpickled, ``__setstate__``): the old one's
autograd hooks are removed first, and the new one has no communication hook, so a closed model runs
torch's C++ all-reduce path exactly as if it had never been watched, and the user may register a
hook of their own afterwards. Where DDP was built with options a fresh reducer would not carry
(mixed precision, the Python reducer of compiled autograd, delayed all-reduce), the hook stays,
switched off: it then calls ``allreduce_hook`` and nothing else.

No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time and
wants the real ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.
"""

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .. import theory

__all__ = ["BucketTiming", "CommTimer", "attach", "detach", "summarize", "timed_allreduce_hook"]

# Where the timer lives on a DDP model, so a second watch of the same model reuses its hook.
_ATTRIBUTE = "_distlab_comm_timer"


@dataclass
class BucketTiming:
    """One all-reduce: what went in, when it was launched and when it completed (``perf_counter``)."""

    bucket: int
    bytes: int
    launched: float
    done: float | None = None
    #: A blocking all-reduce (``Watch.all_reduce``): none of it overlaps compute.
    blocking: bool = False
    #: On a GPU, the CPU clock says when work was queued, not run: CUDA events time it instead.
    events: tuple[Any, Any] | None = None

    def seconds(self) -> float | None:
        if self.events is not None:
            start, end = self.events
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        return None if self.done is None else self.done - self.launched


@dataclass
class CommTimer:
    """The state the DDP hook carries: on or off, and the list the current step's timings go to."""

    process_group: Any
    enabled: bool = False
    timings: list[BucketTiming] = field(default_factory=list)


def timed_allreduce_hook(
    state: CommTimer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """``allreduce_hook``, timed. Its result is returned unchanged, so training is bit-identical."""
    if not state.enabled:
        return default_hooks.allreduce_hook(state.process_group, bucket)
    buffer = bucket.buffer()
    timing = BucketTiming(bucket.index(), buffer.numel() * buffer.element_size(), time.perf_counter())
    if buffer.is_cuda:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        timing.events = (start, torch.cuda.Event(enable_timing=True))
    # Appended now, in launch order; the callback below only stamps it. DDP waits for every bucket
    # before backward returns, so a step's list is complete when the step closes.
    state.timings.append(timing)
    future = default_hooks.allreduce_hook(state.process_group, bucket)

    def finish(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        timing.done = time.perf_counter()
        if timing.events is not None:
            # A CUDA future runs its callbacks on streams that wait for the collective.
            timing.events[1].record()
        return done.value()

    return future.then(finish)


def attach(model: torch.nn.Module) -> tuple[CommTimer | None, str | None]:
    """The timer of a DDP model, its hook registered on first use; (None, why) where that cannot be."""
    if not isinstance(model, DistributedDataParallel):
        return None, None
    timer = getattr(model, _ATTRIBUTE, None)
    if isinstance(timer, CommTimer):
        return timer, None
    timer = CommTimer(model.process_group)
    try:
        model.register_comm_hook(timer, timed_allreduce_hook)
    except RuntimeError as exc:
        # DDP allows one hook per model: the user's own (compression, PowerSGD) is already there.
        return None, f"all-reduce not timed: this DDP model already has a communication hook ({exc})"
    setattr(model, _ATTRIBUTE, timer)
    return timer, None


def detach(model: torch.nn.Module, timer: CommTimer) -> bool:
    """Take the timing hook off ``model``: True when it is gone, False when it stays switched off.

    Call it between steps (no backward in flight) and on every rank alike, as closing a watch in
    the same cell does: the fresh reducer rebuilds its buckets in its first steps, in step with the
    other ranks' fresh reducers.
    """
    timer.enabled = False
    timer.timings = []
    if not isinstance(model, DistributedDataParallel) or getattr(model, _ATTRIBUTE, None) is not timer:
        return False
    if (getattr(model, "mixed_precision", None) is not None or getattr(model, "_use_python_reducer", False)
            or getattr(model, "_delay_all_reduce_all_params", False)
            or [h for h, _ in model._comm_hooks] != [timed_allreduce_hook]):
        return False
    model._remove_autograd_hooks()  # the old reducer must stop seeing gradients before the new one does
    parameters, expect_sparse_gradient = model._build_params_for_reducer()
    names = model._build_debug_param_to_name_mapping(parameters)
    model._ddp_init_helper(parameters, expect_sparse_gradient, names, model.static_graph)
    if model.static_graph:
        model.reducer._set_static_graph()
        model.logger._set_static_graph()
        # A static graph's first step all-reduces at the end of backward, queued once per reducer.
        model._static_graph_delay_allreduce_enqueued = False
    model._comm_hooks = []
    model._has_rebuilt_buckets = False
    delattr(model, _ATTRIBUTE)
    return True


def summarize(
    timings: list[BucketTiming], step_begin: float, world_size: int
) -> tuple[list[dict[str, Any]], float]:
    """Per-bucket dicts for a step's record, and the step's exposed communication time.

    Buckets overlap backward compute; what the step waits for is the tail from the launch of the
    last bucket (backward is done by then) to the completion of the last one. Blocking all-reduces
    are exposed whole.
    """
    buckets: list[dict[str, Any]] = []
    overlapped: list[BucketTiming] = []
    blocking_s = 0.0
    for timing in timings:
        seconds = timing.seconds()
        if seconds is None:
            continue
        entry: dict[str, Any] = {
            "bucket": timing.bucket,
            "bytes": timing.bytes,
            "seconds": seconds,
            "start_s": timing.launched - step_begin,
        }
        if seconds > 0:
            entry["algbw"] = theory.algbw_bytes_per_s(timing.bytes, seconds)
            entry["busbw"] = theory.busbw_bytes_per_s(timing.bytes, seconds, world_size)
        buckets.append(entry)
        if timing.blocking:
            blocking_s += seconds
        else:
            overlapped.append(timing)
    tail_s = 0.0
    if overlapped:
        if any(t.events is not None for t in overlapped):
            # On a GPU the CPU stamps say nothing about overlap: count the collectives' own time.
            tail_s = sum(t.seconds() or 0.0 for t in overlapped)
        else:
            tail_s = max(0.0, max(t.done or t.launched for t in overlapped) - max(t.launched for t in overlapped))
    return buckets, tail_s + blocking_s
