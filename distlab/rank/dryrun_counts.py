"""What the scale dry run (``rank/dryrun.py``) counts on a rank's step, as dispatch modes around it:
every collective op (:class:`Collectives`: op, mesh dimension, group size, bytes in, phase) and this
rank's FLOPs (:class:`LocalFlops`, by torch's formulas on its local ops).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import flop_registry

from ..nn.llama import recomputing
from . import torchcompat_fake
from .torchcompat_dispatch import DispatchMode, Op, collective_group, op_name, wrapper_subclass_in

if TYPE_CHECKING:
    from ..scale.report import CollectiveJSON

__all__ = ["FLOPS", "Collectives", "LocalFlops", "ring_attention_scale"]

_OPS = {  # the dispatcher's collective ops -> the names a report uses
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "send": "send", "recv_": "recv",
}
# Ops whose first argument is where the result goes, the input second.
_OUTPUT_FIRST = {"_allgather_base_", "_reduce_scatter_base_", "allgather_", "reduce_scatter_",
                 "allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_"}


def _permute_or(name: str, args: Sequence[object]) -> str:
    """The report's name for op ``name``: "permute" for an all-to-all whose input all goes to one peer
    (``funcol.permute_tensor``: a step of context parallelism's ring, priced as a send, not as an
    all-to-all of the same bytes)."""
    splits = args[2] if name == "all_to_all_single" and len(args) > 2 else None
    if isinstance(splits, (list, tuple)) and sum(1 for split in splits if split) == 1:
        return "permute"
    return _OPS[name]


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class Collectives(DispatchMode):
    """Counts every collective op of the step: (op, mesh dimension, group size, bytes in, phase) -> calls.

    It also counts the ops DTensor dispatches in forward and backward (``dtensor_ops``): each runs
    Python of its own on the host (its sharding's propagation, redistributions, wrapping) before its
    local ops, which a lab's CPU ranks wait for (``Hardware.host_s_per_dtensor_op``). This mode is the
    step's innermost, the one that sees an op at DTensor's level before DTensor turns it into local ops."""

    def __init__(self, dims_of: dict[str, str]) -> None:
        cast("Callable[[], None]", super().__init__)()  # TorchDispatchMode's, unannotated in torch
        self.dims_of, self.phase, self.calls = dims_of, "forward", Counter[tuple[str, str, int, int, str]]()
        self.dtensor_ops = 0

    def __torch_dispatch__(
        self, func: Op, types: Sequence[type], args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None
    ) -> object:
        if wrapper_subclass_in(types):
            # DTensor first: an op it runs as collectives of its own (context parallelism's ring
            # attention) dispatches them through this mode again, on plain tensors.
            if self.phase != "optimizer" and any(issubclass(t, DTensor) for t in types):
                self.dtensor_ops += 1
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional") and op_name(func) in _OPS:
            name = op_name(func)
            group = collective_group(func, args, kwargs)
            size = int(group.size()) if group is not None else 1
            dim = self.dims_of.get(group.group_name, f"group of {size}") if group is not None else "world"
            payload = _nbytes(args[1] if name in _OUTPUT_FIRST else args[0])
            self.calls[(_permute_or(name, args), dim, size, payload, self.phase)] += 1
        return func(*args, **kwargs)

    def report(self) -> list[CollectiveJSON]:
        return [
            {"op": op, "dim": dim, "group_size": size, "bytes": payload, "calls_per_micro_batch": calls, "phase": phase}
            for (op, dim, size, payload, phase), calls in sorted(self.calls.items())
            if size > 1  # a group of one moves nothing (FSDP2 still calls it when the dimension is 1)
        ]


#: torch's FLOP formulas by op; CPU's fused attention counted as the flash attention it stands for.
FLOPS = {**flop_registry, **torchcompat_fake.cpu_attention_flop_formulas(flop_registry)}


class LocalFlops(DispatchMode):
    """This rank's FLOPs, by torch's formulas (``torch.utils.flop_counter``: matmuls and attention).

    ``FlopCounterMode`` counts a DTensor op at its global shape, once for the whole tensor-parallel
    group; this mode lets DTensor first turn the op into this rank's local ops (as torch's MemTracker
    does) and counts those: what this GPU computes.

    ``attention`` is the part of ``flops`` that attention kernels run (recomputed ones too), and
    ``streamed`` the bytes every other kernel of forward and backward reads and writes, each op's
    tensors in and out (norms, activations, rotary embeddings, casts, residual adds, FSDP's copies):
    each kind of kernel runs at its own rate (``scale.KernelRates``). Views move nothing; eager torch
    runs each op as a kernel of its own. ``fused`` is what a stack that fuses the memory-bound kernels
    between two matmuls (torch.compile, Transformer Engine) still moves (:class:`Chains`).

    ``recomputed`` is the part of ``flops`` computed again: what activation checkpointing runs a second
    time in backward (``distlab.nn.llama.recomputing``), and what flash attention's backward spends
    recomputing the scores ``q @ k^T`` (the first of the five matmuls torch's formula counts for it).
    The GPU computes both, but PaLM's model FLOPs (Chowdhery et al. 2022, appendix B), which MFU
    divides, leave them out."""

    def __init__(self, attention_scale: float = 1.0) -> None:
        cast("Callable[[], None]", super().__init__)()  # TorchDispatchMode's, unannotated in torch
        self.flops = 0
        self.recomputed = 0
        self.attention_scale = attention_scale  # see ``ring_attention_scale``
        self.fp8 = 0  # of ``flops``, what fp8 matmuls (``_scaled_mm``) ran, recomputed ones too
        self.attention = 0
        self.streamed = 0
        self.chains = Chains()
        self.phase = "forward"  # the optimizer's step streams too, but the predictor times it apart
        self.fake_mode = torchcompat_fake.active_fake_mode()  # made inside the step's FakeTensorMode

    def __torch_dispatch__(
        self, func: Op, types: Sequence[type], args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None
    ) -> object:
        if wrapper_subclass_in(types):  # DTensor's local ops, torchao's fp8 matmuls: counted as they run
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        formula = FLOPS.get(func.overloadpacket)
        # Not an op another fake mode runs (DTensor's propagation under this step's own mode is kept
        # from every mode: torchcompat_fake.sharding_propagation_unseen).
        if torchcompat_fake.active_fake_mode() is not self.fake_mode or self.phase == "optimizer":
            return out
        inputs = [*args, *(kwargs or {}).values()]
        name = op_name(func)
        if formula is None:
            if func.namespace in ("c10d", "_c10d_functional"):  # a collective takes what a chain made
                self.chains.leave(inputs)
            elif func.namespace != "aten":  # a device or layout query, the profiler's marks
                pass
            elif func.is_view or name in _UNMARKED_VIEWS:
                self.chains.view(inputs, out)
            elif name not in _MOVES_NOTHING:
                self.streamed += _nbytes(inputs) + _nbytes(out)
                self.chains.run(inputs, out)
            return out
        self.chains.leave(inputs)
        scale = self.attention_scale if "attention" in name else 1.0
        flops = round(scale * formula(*args, **(kwargs or {}), out_val=out))
        self.flops += flops
        if name == "_scaled_mm":
            self.fp8 += flops
        if "attention" in name:
            self.attention += flops
        if recomputing():
            self.recomputed += flops
        elif "attention" in name and name.endswith("_backward"):
            self.recomputed += round(scale * _scores_flops(args[1], args[2]))  # (grad_out, query, key, ...)
        return out


class Chains:
    """What the memory-bound kernels move when a stack fuses each chain of them between two matmuls
    (torch.compile's inductor, Transformer Engine's fused norms, activations and casts): a chain reads
    what it takes from outside it once and writes once what leaves it (for a matmul, attention or a
    collective, or kept past the phase for backward); what passes from one of its ops to the next stays
    in registers. ``bytes`` counts that; ``LocalFlops.streamed`` counts every op's tensors, as eager
    torch runs them."""

    def __init__(self) -> None:
        self.bytes = 0
        self._made: dict[int, weakref.ref[torch.Tensor]] = {}  # by id: a Tensor's == is elementwise

    def _mine(self, t: torch.Tensor) -> bool:
        ref = self._made.get(id(t))
        return ref is not None and ref() is t

    def _keep(self, out: object) -> None:
        for t in _tensors(out):
            self._made[id(t)] = weakref.ref(t)
        if len(self._made) > 200_000:  # ids of tensors since freed
            self._made = {k: r for k, r in self._made.items() if r() is not None}

    def run(self, inputs: Sequence[object], out: object) -> None:
        """A memory-bound op: its inputs from outside the chain are read, its outputs stay in it."""
        self.bytes += sum(_nbytes(t) for t in _tensors(inputs) if not self._mine(t))
        self._keep(out)

    def view(self, inputs: Sequence[object], out: object) -> None:
        """A view of what a chain made is the chain's too."""
        if any(self._mine(t) for t in _tensors(inputs)):
            self._keep(out)

    def leave(self, inputs: Sequence[object]) -> None:
        """A matmul, attention or a collective takes these: what a chain made is written for it, once."""
        for t in _tensors(inputs):
            if self._mine(t):
                self.bytes += _nbytes(t)
                del self._made[id(t)]

    def close(self) -> None:
        """A phase ends: what the chains made and is still alive (kept for backward, the gradients) is written."""
        self.bytes += sum(_nbytes(t) for r in self._made.values() if (t := r()) is not None)
        self._made.clear()


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


#: aten ops that return a view of their input without their schema saying so.
_UNMARKED_VIEWS = {"_unsafe_view"}
#: aten ops that allocate or relabel memory without reading or writing it.
_MOVES_NOTHING = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
                  "lift_fresh", "_local_scalar_dense", "resize_", "set_", "record_stream"}


def ring_attention_scale(cp: int) -> float:
    """What a load-balanced ring's attention FLOPs are multiplied by to count as the whole square counts.

    torch's formula counts an attention call's q x k square whole, causal or not. Without context
    parallelism a rank's causal attention is one call: its square, (2 c n)^2 for a sequence of 2n
    chunks of c tokens, counted whole. Under cp = n, torch's ring runs rank r's two chunks against
    their own (one (2c)^2 call) and then, for each of the n - 1 other ranks, only the half of the
    pairs the causal mask keeps (a 2c x c call): 2 c^2 (n + 1) counted, where the whole square's
    share is 4 c^2 n. Scaling by 2n / (n + 1) keeps MFU's attention term (PaLM counts the square)
    and the compute time as they are without cp, so plans with and without cp compare."""
    return 2 * cp / (cp + 1) if cp > 1 else 1.0


def _scores_flops(query: object, key: object) -> int:
    """The FLOPs of ``query @ key^T`` for (batch, heads, seq, head_dim) tensors, as torch counts a matmul."""
    assert isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
    b, h, s_q, d = query.shape
    return 2 * b * h * s_q * d * key.shape[2]
