"""Every all-reduce bucket of a DDP model timed, with torch's own all-reduce and result.

While a model is watched, DDP's reducer talks to a stand-in for its process group: a Python
``ProcessGroup`` that passes every call to the real one and stamps each bucket's all-reduce at
launch and at completion (CUDA events on a GPU). Closing the watch hands the reducer its own group
back (``torchcompat.set_reducer_group``, the call DDP itself uses to change groups), so nothing of
the watch is left: no hook, no wrapper, the same C++ path as a model never watched.

Why not a DDP communication hook: DDP takes one per model and cannot remove it, and with any hook
registered the reducer stops folding the division by the world size into its copy of the
gradients into the bucket (``mul_out``), so the hook pays one more pass over every bucket (measured:
0.3 ms per 8 MB bucket, 1-2% of a step at 4M parameters). The stand-in changes neither.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import theory
from ..rank import torchcompat, torchcompat_compile
from ..records import AllReduceBucket, Collective
from ..theory.collectives import COLLECTIVES, bus_bandwidth_factor
from .ops import CollectiveTiming, Stamped

if TYPE_CHECKING:
    from .ops import OpObserver

__all__ = ["BucketTiming", "CommTimer", "TimedGroup", "attach", "detach", "summarize", "summarize_collectives",
           "timed_all_reduce"]


@dataclass
class BucketTiming(Stamped):
    """One all-reduce: what went in, when it was launched and when it completed (``perf_counter``)."""

    bucket: int
    bytes: int
    launched: float
    done: float | None = None
    #: A blocking all-reduce (``Watch.all_reduce``): none of it overlaps compute.
    blocking: bool = False
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None


#: A reduction as ``dist.all_reduce`` takes it: ``dist.ReduceOp.SUM`` (a ``RedOpType``) or a ``ReduceOp``.
ReduceOpLike: TypeAlias = "dist.ReduceOp.RedOpType | dist.ReduceOp"


@dataclass
class CommTimer:
    """On or off, and the list the current step's timings go to (the watch swaps it each step)."""

    enabled: bool = False
    timings: list[BucketTiming] = field(default_factory=list)
    #: The stand-in group the reducer holds while the model is watched.
    group: TimedGroup | None = None


class TimedGroup(dist.ProcessGroup):
    """A model's process group as its DDP reducer sees it while watched: all-reduces timed, all else passed on.

    The reducer launches buckets in index order, so a step's n-th gradient all-reduce is bucket n.
    Non-float all-reduces are DDP's bookkeeping (the used-parameter map of
    ``find_unused_parameters``), passed on untimed.
    """

    def __init__(self, inner: dist.ProcessGroup, timer: CommTimer) -> None:
        # torch's stub lists only the (store, rank, size) constructor; pybind's (rank, size) one is the
        # constructor of a group written in Python.
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]  # pybind's, not in the stub
        self.inner = inner
        self.timer = timer

    # Not for torch.compile to trace (hence not_compiled): the reducer calls these from C++,
    # and inside a compiled DDP forward (rebuilding buckets) torch.compile took each call for a frame
    # to compile and failed on the stand-in group ("ProcessGroup name not set").
    # The reducer calls these four with (tensors, [...], opts) only: the other call forms of the base
    # class's overloads never reach a stand-in (hence the narrowed signatures, [override]).
    @torchcompat_compile.not_compiled
    def allreduce(  # type: ignore[override]  # the reducer's one call form (above)
        self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions
    ) -> dist.Work:
        timer = self.timer
        if not timer.enabled or len(tensors) != 1 or not tensors[0].is_floating_point():
            return self.inner.allreduce(tensors, opts)
        buffer = tensors[0]
        timing = BucketTiming(len(timer.timings), buffer.numel() * buffer.element_size(), time.perf_counter())
        if buffer.is_cuda:
            timing.start_events()
        timer.timings.append(timing)
        work = self.inner.allreduce(tensors, opts)

        def finish(done: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
            timing.done = time.perf_counter()
            if timing.events is not None:
                # A CUDA future runs its callbacks on streams that wait for the collective.
                timing.events[1].record()
            return done.value()

        # The reducer waits for this future, so the stamp is taken before backward returns and
        # the result it reads is the real group's, untouched.
        return torchcompat.work_from_future(work.get_future().then(finish))

    # What else a reducer asks of its group: bucket order is broadcast from rank 0 when buckets
    # are rebuilt; the rest is here so nothing reaches the base class, which has no backend.
    @torchcompat_compile.not_compiled
    def broadcast(self, tensors: list[torch.Tensor], opts: object) -> dist.Work:  # type: ignore[override]  # as above
        return self.inner.broadcast(tensors, opts)

    @torchcompat_compile.not_compiled
    def allgather(  # type: ignore[override]  # the reducer's one call form
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: object
    ) -> dist.Work:
        return self.inner.allgather(output_tensors, input_tensors, opts)

    @torchcompat_compile.not_compiled
    def barrier(self, opts: object) -> dist.Work:  # type: ignore[override]  # the reducer's one call form
        return self.inner.barrier(opts)

    @torchcompat_compile.not_compiled
    def getBackendName(self) -> str:  # torch's name
        return self.inner.name()


def attach(model: torch.nn.Module) -> tuple[CommTimer | None, str | None]:
    """Give a DDP model's reducer the timing stand-in for its group: (timer, None), or (None, why not)."""
    if not isinstance(model, DistributedDataParallel):
        return None, None
    hooks = torchcompat.comm_hook_names(model)
    if hooks:
        # A hook (fp16 compression, PowerSGD, mixed precision's) makes its own calls to the group.
        return None, f"all-reduce not timed: this DDP model has a communication hook ({', '.join(hooks)})"
    if not torchcompat.swappable_reducer(model):
        return None, "all-reduce not timed: this DDP model has no reducer whose group can be swapped"
    timer = CommTimer()
    timer.group = TimedGroup(model.process_group, timer)
    torchcompat.set_reducer_group(model, timer.group)
    return timer, None


def detach(model: torch.nn.Module, timer: CommTimer) -> None:
    """Hand the reducer its own group back. Between steps, as closing a watch is."""
    timer.enabled = False
    timer.timings = []
    if timer.group is not None:
        torchcompat.set_reducer_group(model, timer.group.inner)
        timer.group = None


def summarize(
    timings: list[BucketTiming], step_begin: float, world_size: int
) -> tuple[list[AllReduceBucket], float]:
    """The buckets of a step's record, and the step's exposed communication time.

    Buckets overlap backward compute; what the step waits for is the tail from the launch of the
    last bucket (backward is done by then) to the completion of the last one. Blocking all-reduces
    are exposed whole.
    """
    buckets: list[AllReduceBucket] = []
    overlapped: list[BucketTiming] = []
    blocking_s = 0.0
    for timing in timings:
        seconds = timing.seconds()
        if seconds is None:
            continue
        entry: AllReduceBucket = {
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


def summarize_collectives(
    timings: list[CollectiveTiming], step_begin: float, step_end: float | None = None
) -> tuple[list[Collective], float]:
    """The collectives of a step's record (seen op by op), and the time any of them was in flight.

    In flight, not exposed: a prefetched all-gather runs while the rank computes, and nothing on
    the CPU says how much of it the rank waited for. The union of the intervals is the most it
    could have cost the step. Only collectives launched by ``step_end`` count towards it: those
    launched after the update (averaging the models every H steps) are listed, not counted.
    """
    out: list[Collective] = []
    spans: list[tuple[float, float]] = []
    for timing in timings:
        seconds = timing.seconds()
        if seconds is None:
            continue
        entry: Collective = {"op": timing.op, "bytes": timing.bytes, "ranks": timing.ranks, "seconds": seconds,
                             "start_s": timing.launched - step_begin}
        if timing.layer is not None:
            entry["layer"] = timing.layer
        if timing.untimed:
            entry["untimed"] = True
        if seconds > 0:
            entry["algbw"] = theory.algbw_bytes_per_s(timing.bytes, seconds)
            if timing.op in COLLECTIVES and timing.ranks > 1:
                entry["busbw"] = entry["algbw"] * bus_bandwidth_factor(timing.op, timing.ranks)
        out.append(entry)
        if step_end is None or timing.launched <= step_end:
            spans.append((timing.launched, timing.launched + seconds))
    in_flight = 0.0
    end = float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            in_flight += stop - max(start, end)
            end = stop
    return out, in_flight


def timed_all_reduce(
    timings: list[BucketTiming], observer: OpObserver | None, tensor: torch.Tensor, op: ReduceOpLike | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``dist.all_reduce(tensor)`` timed as the next bucket of ``timings`` (``Watch.all_reduce``); the
    watch's op ``observer``, if any, does not time it again."""
    timing = BucketTiming(len(timings), tensor.numel() * tensor.element_size(), time.perf_counter(), blocking=True)
    held = observer.timings if observer is not None else None
    if observer is not None:
        observer.timings = None  # timed here, as a bucket: not again op by op
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    finally:
        if observer is not None:
            observer.timings = held
    timing.done = time.perf_counter()
    timings.append(timing)
    return tensor
