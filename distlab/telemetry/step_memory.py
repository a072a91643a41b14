"""A step's memory, as a watch records it (``telemetry/watch.py``): the model's state on this rank
when the step began, plus the most that the step's own tensors held at once.

On CUDA the peak comes from torch's allocator; on the CPU from the storages the watch's op observer
counts (``telemetry/storages.py``), which ``live`` is.
"""

from __future__ import annotations

import weakref

import torch

from ..records import MemoryUse
from .memory import HeldMemory, model_memory
from .steps import Step
from .storages import LiveTensors

__all__ = ["StepMemory"]


class StepMemory:
    """What a watched model holds, and each step's peak, on ``cuda`` or (``cuda`` None) counted by ``live``."""

    def __init__(self, params: list[torch.Tensor], cuda: torch.device | None, live: LiveTensors | None) -> None:
        self.params = params
        self.cuda = cuda
        self.live = live
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # the watch adds its own

    def held(self) -> HeldMemory:
        """The model's parameters, gradients and its optimizers' state on this rank, in bytes."""
        held = model_memory(self.params)
        held["optimizer_bytes"] = sum(model_memory([], opt)["optimizer_bytes"] for opt in list(self.optimizers))
        return held

    def begin(self, step: Step) -> None:
        """The step begins: what is held now, and the peak counted from here."""
        held = self.held()
        step.resident = held["parameters_bytes"] + held["gradients_bytes"] + held["optimizer_bytes"]
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
            step.live_at_begin = torch.cuda.memory_allocated(self.cuda)
        elif self.live is not None:
            self.live.reset_peak()
            step.live_at_begin = self.live.current

    def record(self, step: Step) -> MemoryUse:
        """The step's memory record: model state now, and the step's peak (see ``records.MemoryUse``)."""
        if self.cuda is not None:
            made = torch.cuda.max_memory_allocated(self.cuda) - step.live_at_begin
        else:
            made = self.live.peak - step.live_at_begin if self.live is not None else 0
        return {**self.held(), "peak_bytes": step.resident + max(0, made)}
