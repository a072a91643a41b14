"""What a rank holds in memory: its model's tensors, and the peak of a block of code.

Two measurements:

* :func:`model_memory`: the bytes of a model's parameters, gradients and optimizer state that live
  on this rank, counting the local shard of a sharded tensor (FSDP2, tensor parallelism), so the
  numbers compare with ``distlab.theory.sharded_memory`` directly.
* :func:`track_memory`: the most bytes of tensors made inside a ``with`` block that were alive at
  once. On a GPU that is torch's own allocator statistics. A CPU has no such statistics (torch's
  CPU allocator keeps none), so :class:`LiveTensors` counts them: every op's new output storages are
  added when they are made and taken off when Python frees them (a weak reference's callback runs
  at the moment the last reference goes, CPython frees by reference count). It sees tensors made by
  ops; memory a library allocates outside torch's ops (a communication backend's own buffers) is
  not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypedDict

import torch

from ..rank import torchcompat_dispatch
from .ops import OpObserver
from .storages import LiveTensors, local_tensor, makes_storage, storage_key

__all__ = ["LiveTensors", "MemoryUse", "local_tensor", "makes_storage", "model_memory", "track_memory"]
# LiveTensors, local_tensor and makes_storage live in .storages (ops counts storages too): named here as before.


def _bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind ``tensors`` (local shards), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = storage_key(local_tensor(t))
        if key is None or key[0].data_ptr() in seen:
            continue
        seen.add(key[0].data_ptr())
        total += key[1]
    return total


class HeldMemory(TypedDict):
    """What a rank holds for a model, in bytes (:func:`model_memory`)."""

    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int


def model_memory(
    model: torch.nn.Module | Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None
) -> HeldMemory:
    """{parameters_bytes, gradients_bytes, optimizer_bytes} this rank holds for a model.

    ``model`` is a module or its parameters. Optimizer state is every tensor in ``optimizer.state``
    (Adam's step counter included); a ZeroRedundancyOptimizer holds only its shard's state.
    """
    params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
    state: list[torch.Tensor] = []
    if optimizer is not None:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
        for per_param in getattr(inner, "state", {}).values():
            state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return {
        "parameters_bytes": _bytes(params),
        "gradients_bytes": _bytes(p.grad for p in params),
        "optimizer_bytes": _bytes(state),
    }


class MemoryUse:
    """What :func:`track_memory` measured: ``peak_bytes`` and ``retained_bytes`` (set when the block ends)."""

    def __init__(self, device: str) -> None:
        self.device = device
        #: The most bytes of tensors made in the block alive at once.
        self.peak_bytes = 0
        #: Bytes made in the block still alive when it ended.
        self.retained_bytes = 0

    def __repr__(self) -> str:
        return (f"<MemoryUse on {self.device}: peak {self.peak_bytes / 2**20:.2f} MiB, "
                f"retained {self.retained_bytes / 2**20:.2f} MiB>")


@contextmanager
def track_memory(device: torch.device | str | None = None) -> Iterator[MemoryUse]:
    """Measure the peak memory of the tensors a block makes, on this rank::

        with distlab.telemetry.track_memory() as mem:
            loss = model(x).sum()
        mem.peak_bytes

    ``device``: where to measure; by default CUDA's current device when CUDA is in use, else the CPU.
    On CUDA the peak is ``max_memory_allocated`` above what was allocated at entry (it also sees
    allocations outside torch's ops); on the CPU, :class:`LiveTensors` counts the storages the block's
    ops make. Only this thread's ops are seen on the CPU: autograd runs CPU backward on the calling
    thread, so ``loss.backward()`` inside the block is counted.
    """
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and torch.cuda.is_initialized()
        else torch.device("cpu"))
    use = MemoryUse(str(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            yield use
        finally:
            torch.cuda.synchronize(dev)
            use.peak_bytes = torch.cuda.max_memory_allocated(dev) - start
            use.retained_bytes = torch.cuda.memory_allocated(dev) - start
        return
    live = LiveTensors()
    mode = OpObserver(memory=live)
    undo = torchcompat_dispatch.watch_storage_resizes(live.resized)
    try:
        with torchcompat_dispatch.dispatch_mode(mode):
            try:
                yield use
            finally:
                use.peak_bytes = live.peak
                use.retained_bytes = live.current
    finally:
        undo()
