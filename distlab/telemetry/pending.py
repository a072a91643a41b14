"""GPU steps closed whose records still wait for the GPU (``telemetry/watch.py``).

On a GPU the CPU runs ahead: when a step's update has been queued, the collectives it timed with CUDA
events and the loss it logged as a tensor may not have run yet. Reading them then (an event's
``elapsed_time``, a tensor's ``item()``) would make the CPU wait for the GPU every step, which halved
a small DDP model's steps per second on an H200 (benchmarks/RESULTS.md). A closed step is kept here
with an event recorded at its close; its record is completed once that event has completed (checked
without waiting at each step's start), or at once, waiting, when someone reads the records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from ..records import StepRecord
from .steps import Step, metric_fields

__all__ = ["MAX_WAITING", "PendingSteps"]

#: Steps that may wait for the GPU before the oldest is completed waiting (the CPU runs ahead a few steps).
MAX_WAITING = 8


class PendingSteps:
    """Closed GPU steps, oldest first, and the ids of their records (held back from publishing)."""

    def __init__(self) -> None:
        self._steps: deque[Step] = deque()
        self.record_ids: set[int] = set()  # read by the publisher thread under the watch's lock

    def __contains__(self, step: Step) -> bool:
        return step in self._steps

    def add(self, step: Step) -> None:
        """Hold ``step`` (its record made without what the GPU has not yet done) until the GPU is there."""
        step.done_event = torch.cuda.Event()
        step.done_event.record()
        self._steps.append(step)

    def resolve(self, wait: bool, world_size: int, replace: Callable[[StepRecord, StepRecord], None]) -> bool:
        """Complete the records of the steps the GPU has finished (``wait``: of every one, waiting for
        the GPU); ``replace(old, new)`` swaps each in where the watch keeps it. True if any was."""
        done = False
        while self._steps:
            step = self._steps[0]
            event = step.done_event
            assert event is not None  # recorded by add
            if not wait and len(self._steps) <= MAX_WAITING and not event.query():
                break
            event.synchronize()
            old = step.record
            assert old is not None
            step.record = {**old, **step.timed_fields(world_size), **metric_fields(step.metrics)}
            replace(old, step.record)
            self._steps.popleft()
            done = True
        return done
