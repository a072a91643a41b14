"""A watched step while it runs, and what closes it and fills its record (``telemetry/watch.py``).

:class:`Step` holds what a step gathers from its first forward to the next step's (timings, the
memory it began with, what ``distlab.log`` gave); :func:`wrapped_by_zero` tells the optimizer whose
step does not close one; :func:`metric_value` and :func:`metric_fields` turn logged values into the
record's fields.
"""

from __future__ import annotations

import gc
import time
from typing import TypedDict

import torch

from ..rank import models
from ..records import AllReduceBucket, Collective, MemoryUse, StepRecord
from . import comm
from .ops import CollectiveTiming

__all__ = ["MetricFields", "Step", "metric_fields", "metric_value", "wrapped_by_zero"]


class TimedFields(TypedDict):
    """A step record's fields read from its timed collectives (:meth:`Step.timed_fields`)."""

    allreduce: list[AllReduceBucket]
    collectives: list[Collective]
    comm_s: float
    compute_s: float


class Step:
    """One training step of a watch, from its first forward to its update (and its record, once made)."""

    __slots__ = ("begin", "closed_with", "collectives", "done_event", "end", "gap_s", "live_at_begin", "metrics",
                 "number", "record", "resident", "timings", "version", "wall")

    def __init__(self, number: int, gap_s: float | None, version: int) -> None:
        self.number = number
        self.version = version  # of the weights when the step began: a change means an update
        self.begin = time.perf_counter()
        self.wall = time.time()
        self.gap_s = gap_s
        self.timings: list[comm.BucketTiming] = []
        self.collectives: list[CollectiveTiming] = []
        self.closed_with = 0  # collectives in its record: more may come after the update (see Watch._take_late)
        self.resident = 0  # parameter, gradient and optimizer bytes when the step began
        self.live_at_begin = 0  # what the live-tensor count said then (CPU)
        self.metrics: dict[str, float | torch.Tensor] = {}
        self.record: StepRecord | None = None  # set when the step closes
        self.end = 0.0  # perf_counter when it closed
        # On a GPU: recorded on the stream when the step closed; once it has completed, so has every
        # collective timed in the step and every value logged in it, and reading them waits for nothing.
        self.done_event: torch.cuda.Event | None = None

    def timed_fields(self, world_size: int) -> TimedFields:
        """The record's fields that read the step's timed collectives (on a GPU, their CUDA events)."""
        step_time_s = self.end - self.begin
        buckets, comm_s = comm.summarize(self.timings, self.begin, world_size)
        collectives, in_flight_s = comm.summarize_collectives(self.collectives, self.begin, self.end)
        comm_s = min(comm_s + in_flight_s, step_time_s)  # what was still in flight counts as exposed
        return {"allreduce": buckets, "collectives": collectives, "comm_s": comm_s, "compute_s": step_time_s - comm_s}

    def new_record(
        self, rank: int, world_size: int, end: float, memory: MemoryUse | None, timed: bool = True
    ) -> StepRecord:
        """The step's record, its update done at ``end`` (``perf_counter``): its times, its timed
        collectives (``timed=False``: none yet, see ``timed_fields``) and ``memory``; the watch adds the
        sampled norms and checksums, and the metrics."""
        self.end = end
        step_time_s = end - self.begin
        fields: TimedFields = self.timed_fields(world_size) if timed else {
            "allreduce": [], "collectives": [], "comm_s": 0.0, "compute_s": step_time_s}
        return {
            "rank": rank,
            "step": self.number,
            "t": self.wall,
            "epoch": None,
            "loss": None,
            "metrics": {},
            "step_time_s": step_time_s,
            "compute_s": fields["compute_s"],
            "comm_s": fields["comm_s"],
            "idle_s": self.gap_s,
            "allreduce": fields["allreduce"],
            "collectives": fields["collectives"],
            "memory": memory,
            "grad_norm": {},
            "weight_norm": {},
            "update_ratio": {},
            "checksum": None,
            "layer_checksums": None,
        }


def wrapped_by_zero(optimizer: torch.optim.Optimizer) -> bool:
    """True for the local optimizer inside a ZeroRedundancyOptimizer.

    Its step ends before the wrapper broadcasts the updated shards: closing the step there would
    take checksums of half-updated replicas (and flag a divergence that is not there). The
    wrapper's own step, which ends after the broadcast, closes it instead. Checked once per optimizer.
    """
    # A dict referring to it may be the wrapper's __dict__, holding it as .optim.
    return any(isinstance(ref, dict) and any(models.is_zero_optimizer(o) and getattr(o, "__dict__", None) is ref
                                             for o in gc.get_referrers(ref))
               for ref in gc.get_referrers(optimizer))


def metric_value(name: str, value: object) -> float | torch.Tensor:
    """A logged value as the record keeps it: a float, or a GPU tensor's detached copy until its step's
    record is made (reading it at once would make the CPU wait for the GPU every step)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"log({name}=...) takes a number or a one-element tensor, got shape {tuple(value.shape)}")
        return value.detach().clone() if value.is_cuda else float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"log({name}=...) takes a number, got {type(value).__name__}")
    return float(value)


class MetricFields(TypedDict, total=False):
    """A step record's fields that ``distlab.log`` sets (as ``StepRecord`` types them)."""

    metrics: dict[str, float]
    loss: float | None
    epoch: int | None


def metric_fields(metrics: dict[str, float | torch.Tensor]) -> MetricFields:
    """The record's fields that ``distlab.log`` sets: metrics, and loss and epoch when logged."""
    values = {k: float(v) for k, v in metrics.items()}  # a GPU tensor's value is read here
    fields: MetricFields = {"metrics": {k: v for k, v in values.items() if k not in ("loss", "epoch")}}
    if "loss" in values:
        fields["loss"] = values["loss"]
    if "epoch" in values:
        fields["epoch"] = int(values["epoch"])
    return fields
