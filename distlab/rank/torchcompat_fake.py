"""The private torch APIs behind the scale dry run (``rank/dryrun.py``): fake tensors, a fake process
group, a memory tracker, and the FLOP formulas of the attention kernels it runs.

``rank/torchcompat.py``'s rule holds here: each private API is called in this module and nowhere else,
with what it does and why no public API does it. Importing it imports ``torchcompat_release`` first, so the
torch release is checked before any of these are touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

from . import torchcompat_release  # noqa: F401 - checks the torch release before anything here is used

__all__ = [
    "active_fake_mode",
    "cpu_attention_flop_formulas",
    "fake_store",
    "fake_tensor_mode",
    "memory_tracker",
    "sharding_propagation_unseen",
    "tracked_peak_bytes",
]


def fake_store() -> dist.Store:
    """A store for ``dist.init_process_group("fake", store=..., rank=r, world_size=n)``: torch's fake
    process-group backend, whose collectives return at once and move nothing, so one process can be any
    rank of a world of any size (``distlab.rank.dryrun``). ``torch.testing._internal.distributed.fake_pg``
    is torch's own test utility (torchtitan validates its configurations with it); no public API offers
    a process group that is not backed by peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fake_tensor_mode() -> FakeTensorMode:
    """``torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)``: tensors with shapes,
    dtypes and devices but no data, and every op computed from shapes alone. Private module; the
    documented way (``torch._subclasses``) to run a model without its memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def memory_tracker(
    *tracked: torch.nn.Module | torch.optim.Optimizer, observe: Callable[[int], None] | None = None
) -> MemTracker:
    """``torch.distributed._tools.mem_tracker.MemTracker`` tracking ``tracked`` (modules, optimizers):
    a dispatch mode counting the bytes of every tensor alive, FSDP2's storage resizes included, and
    its peak; it works under FakeTensorMode. Read with :func:`tracked_peak_bytes`; ``observe`` is
    called with the bytes alive (``"Total"`` over all devices) after every op.

    ``_update_peak_stats`` runs after every op and, besides the global peak, walks every module seen so
    far for per-module peaks, which the dry run does not read: at Llama 3's 32 to 126 blocks that walk
    was half of a dry run's time. Overridden to keep the global peak alone (its snapshot, as torch's)."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import MemTracker

    class GlobalPeak(MemTracker):
        def _update_peak_stats(self, peak_state: object) -> None:  # a _State: only the global peak is kept
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = deepcopy(snap)
            if observe is not None:
                observe(sum(snap["Total"] for snap in self._curr_mem_snap.values()))

    tracker = GlobalPeak()
    tracker.track_external(*tracked)
    return tracker


def _tracked_total(tracker: MemTracker, which: str) -> int:
    return int(sum(snap.get("Total", 0) for snap in tracker.get_tracker_snapshot(which).values()))


def tracked_peak_bytes(tracker: MemTracker) -> int:
    """The most bytes a :func:`memory_tracker` saw alive at once, over all devices (``"Total"``)."""
    return _tracked_total(tracker, "peak")


def tracked_current_bytes(tracker: MemTracker) -> int:
    """The bytes a :func:`memory_tracker` sees alive now, over all devices (``"Total"``)."""
    return _tracked_total(tracker, "current")


def active_fake_mode() -> FakeTensorMode | None:
    """The FakeTensorMode active now, or None (``torch._guards.active_fake_mode``). DTensor propagates
    shardings by running each new op signature at its global shape under a FakeTensorMode: a new one
    where none is active, else the active one. A mode that counts what a rank computes (the dry run's
    FLOPs) skips ops run under another mode than its own, as torch's MemTracker does; under its own
    mode it cannot tell them apart (the dry run hides them: :func:`sharding_propagation_unseen`)."""
    from torch._guards import active_fake_mode as active

    return active()


@contextmanager
def sharding_propagation_unseen() -> Iterator[None]:
    """While open, DTensor's sharding propagation runs with every dispatch mode set aside but the
    active FakeTensorMode, so the modes around a step (the memory tracker, the FLOP and collective
    counters) see only the ops a rank runs.

    DTensor works out an op's output by running the op at its global shape
    (``ShardingPropagator._propagate_tensor_meta_non_cached``), and under a FakeTensorMode it does so
    for every op, uncached (``_are_we_tracing()`` is true). The memory tracker counted those global
    tensors: in a loss-parallel backward at tp 8 a [tokens, vocabulary] fp32 tensor the GPU never
    holds, 6.6 of 8.6 GiB of "activations" for a 2-layer model with Llama 3's vocabulary at 8,192
    tokens. No public API runs that propagation apart from the modes; the method is wrapped here."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    name = "_propagate_tensor_meta_non_cached"
    original = getattr(ShardingPropagator, name)

    def unseen(self: ShardingPropagator, op_schema: object) -> object:
        mode = active_fake_mode()
        with _disable_current_modes(), mode if mode is not None else nullcontext():
            return original(self, op_schema)

    setattr(ShardingPropagator, name, unseen)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)


def cpu_attention_flop_formulas(registry: Mapping[object, Callable[..., int]]) -> dict[object, Callable[..., int]]:
    """FLOP formulas (``torch.utils.flop_counter``'s ``flop_registry``) for CPU's fused attention ops,
    each the formula of the GPU flash-attention op it stands for (the same arguments first): the dry
    run runs CPU kernels, the step it stands for runs flash attention.

    ``aten._scaled_dot_product_flash_attention`` (and ``_for_cpu``, ``_backward``): the ops
    ``scaled_dot_product_attention`` dispatches to, which the dispatcher sees; torch registers no
    formula for the CPU ones, and the public op is never seen below autograd.
    """
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: registry[aten._scaled_dot_product_flash_attention],
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            registry[aten._scaled_dot_product_flash_attention_backward],
    }
