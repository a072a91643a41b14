"""The tensor storages that ops make, counted while they live: what :func:`memory.track_memory`
measures on a CPU, where torch's allocator keeps no statistics.

Every op's new output storages are added when they are made and taken off when Python frees them (a
weak reference's callback runs at the moment the last reference goes, CPython frees by reference
count). :class:`ops.OpObserver` shows each op's results to a :class:`LiveTensors` as it dispatches.
"""

from __future__ import annotations

import weakref

import torch

from ..rank import torchcompat, torchcompat_dispatch

__all__ = ["LiveTensors", "local_tensor", "makes_storage", "storage_key"]


#: The part of a tensor this rank stores: a DTensor's local shard, any other tensor itself.
local_tensor = torchcompat.local_tensor


def storage_key(tensor: torch.Tensor) -> tuple[torch.UntypedStorage, int] | None:
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
        # weak reference -> storage; keeps the references alive
        self._refs: dict[weakref.ref[torch.UntypedStorage], int] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def add_outputs(self, out: object) -> None:
        """Count the storages an op that makes new ones (see :func:`makes_storage`) returned."""
        if isinstance(out, torch.Tensor):
            self._add(out)
            return
        for t in (out if isinstance(out, (tuple, list)) else torchcompat.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, tensor: torch.Tensor) -> None:
        key = storage_key(local_tensor(tensor))
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

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage`` was resized in place from ``before`` bytes: count the difference."""
        change = storage.nbytes() - before
        cdata = torchcompat.storage_id(storage)
        if cdata in self._live:
            self._live[cdata] += change  # what its weak reference's callback will take off
        self.current += change
        self.peak = max(self.peak, self.current)

    def _freed(self, ref: weakref.ref[torch.UntypedStorage]) -> None:
        cdata = self._refs.pop(ref, None)
        if cdata is not None:
            self.current -= self._live.pop(cdata, 0)


def makes_storage(func: torchcompat_dispatch.Op) -> bool:
    """False for an op whose schema lets a result alias an input: it returns memory that already existed."""
    return not torchcompat_dispatch.op_returns_alias(func)
