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

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..rank import torchcompat, torchcompat_dispatch

__all__ = ["LiveTensors", "MemoryUse", "local_tensor", "makes_storage", "model_memory", "track_memory"]


#: The part of a tensor this rank stores: a DTensor's local shard, any other tensor itself.
local_tensor = torchcompat.local_tensor


def _storage_key(tensor: torch.Tensor) -> tuple[Any, int] | None:
    """(storage, bytes) of a plain tensor with real memory; None for meta, fake or subclass wrappers."""
    try:
        storage = tensor.untyped_storage()
        # A fake tensor (DTensor's sharding propagation and FSDP2 make them inside a step) reports a
        # real device but keeps a meta storage; asking that storage for its data pointer makes torch
        # warn on every rank. Its device says first that there is no memory to count.
        if storage.device.type == "meta" or storage.data_ptr() == 0:
            return None
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
        return None
    return storage, storage.nbytes()


def _bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind ``tensors`` (local shards), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = _storage_key(local_tensor(t))
        if key is None or key[0].data_ptr() in seen:
            continue
        seen.add(key[0].data_ptr())
        total += key[1]
    return total


def model_memory(model: torch.nn.Module | Iterable[torch.Tensor], optimizer: Any = None) -> dict[str, int]:
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


class LiveTensors:
    """Bytes of live tensor storages made by the ops it is shown (see :meth:`add_outputs`), and their peak.

    Cheap per op, since every op of a step passes through it: an op whose schema says a result may
    alias an input (a view, an in-place or ``out=`` op) makes no storage and is skipped unread; the
    others' results are new storages, each counted once and taken off by a weak reference's callback.
    Storages are known by their C++ object, which a resize keeps: FSDP2 gathers a layer's weights
    into storages it grows and shrinks in place (``UntypedStorage.resize_``, no op), and
    :meth:`resized` counts those changes.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # storage (its C++ object) -> bytes counted for it
        self._refs: dict[Any, int] = {}  # weak reference -> storage; keeps the references alive

    def reset_peak(self) -> None:
        self.peak = self.current

    def add_outputs(self, out: Any) -> None:
        """Count the storages an op that makes new ones (see :func:`makes_storage`) returned."""
        if isinstance(out, torch.Tensor):
            self._add(out)
            return
        for t in (out if isinstance(out, (tuple, list)) else torchcompat.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, tensor: torch.Tensor) -> None:
        key = _storage_key(local_tensor(tensor))
        if key is None:
            return
        storage, nbytes = key
        cdata = torchcompat.storage_id(storage)
        if cdata in self._live:
            return
        self._live[cdata] = nbytes
        self._refs[weakref.ref(storage, self._freed)] = cdata
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def resized(self, storage: Any, before: int) -> None:
        """``storage`` was resized in place from ``before`` bytes: count the difference."""
        change = storage.nbytes() - before
        cdata = torchcompat.storage_id(storage)
        if cdata in self._live:
            self._live[cdata] += change  # what its weak reference's callback will take off
        self.current += change
        self.peak = max(self.peak, self.current)

    def _freed(self, ref: Any) -> None:
        cdata = self._refs.pop(ref, None)
        if cdata is not None:
            self.current -= self._live.pop(cdata, 0)


def makes_storage(func: Any) -> bool:
    """False for an op whose schema lets a result alias an input: it returns memory that already existed."""
    return not torchcompat_dispatch.op_returns_alias(func)


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
    from .ops import OpObserver  # ops reads this module's makes_storage: imported when used

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
