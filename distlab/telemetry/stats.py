"""Per-layer statistics of a model's parameters, batched with torch's fused ``foreach`` kernels.

A layer is a module that owns parameters itself (``Linear`` with its weight and bias); its norm is
the 2-norm of all its parameters together. One batched norm (``torchcompat.foreach_norm``) covers
every parameter, so the cost is a pass over the memory, not a Python loop of kernels.

A sharded parameter (FSDP2, tensor parallelism: a DTensor with a ``Shard`` placement) is read where it
lives: this rank's shard. Its layer is listed in ``sharded``; its norms are of the shard and its
checksum is the shard's (ranks differ by design: the dashboard compares only layers that are not
sharded). Checksums are sums, so the shards' checksums add up to the whole layer's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..rank import torchcompat
from .memory import local_tensor

__all__ = ["LayerIndex"]

# Integer views of the same width, and the sum's type, for exact checksums of the raw bits. Sums wrap
# (modulo 2^32, 2^64), which keeps them exact and independent of the order of addition; an int32
# accumulator is ~100x faster than widening every element to int64.
_BITS = {1: (torch.uint8, torch.int32), 2: (torch.int16, torch.int32), 4: (torch.int32, torch.int32),
         8: (torch.int64, torch.int64)}


class LayerIndex:
    """A model's trainable parameters, grouped by the module that owns them, in module order."""

    def __init__(self, module: torch.nn.Module) -> None:
        names: list[str] = []
        params: list[torch.Tensor] = []
        owner: list[int] = []
        seen: set[int] = set()
        for name, mod in module.named_modules():
            own = [p for p in mod.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
            if not own:
                continue
            names.append(name or "(root)")
            for p in own:
                seen.add(id(p))
                params.append(p)
                owner.append(len(names) - 1)
        self.names = names
        self.params = params
        #: Layers with a parameter sharded across ranks (a DTensor with a Shard placement).
        self.sharded = sorted({names[owner[i]] for i, p in enumerate(params) if _is_sharded(p)},
                              key=names.index)
        self._owner = torch.tensor(owner, dtype=torch.long)
        #: What one step's gradients weigh: the bytes a data-parallel step all-reduces.
        self.grad_bytes = sum(p.numel() * p.element_size() for p in params)  # whole tensors, sharded or not
        self._buffers: list[torch.Tensor] | None = None  # snapshot()'s, reused

    def _combine(self, per_param: torch.Tensor, which: list[int], dtype: torch.dtype) -> list[float | int]:
        """Sum per-parameter values (one per index in ``which``) into per-layer values, on the CPU."""
        values = per_param.cpu().to(dtype)
        out = torch.zeros(len(self.names), dtype=dtype)
        out.index_add_(0, self._owner[which], values)
        return out.tolist()

    def norms(self, tensors: Sequence[torch.Tensor | None]) -> dict[str, float]:
        """{layer: 2-norm of its tensors}, for tensors aligned with ``params`` (None: left out)."""
        which = [i for i, t in enumerate(tensors) if t is not None]
        if not which:
            return {}
        present = [local_tensor(t) for t in tensors if t is not None]  # aligned with which
        with torch.no_grad():
            norms = torchcompat.foreach_norm(present)
            squares = self._combine(_stack_cpu(norms).double().square(), which, torch.float64)
        layers = set(self._owner[which].tolist())
        return {name: float(squares[i]) ** 0.5 for i, name in enumerate(self.names) if i in layers}

    def weight_norms(self) -> dict[str, float]:
        return self.norms(self.params)

    def local_params(self) -> list[torch.Tensor]:
        """The parameters as this rank stores them (the local shard of a sharded one)."""
        return [local_tensor(p) for p in self.params]

    def grad_norms(self) -> dict[str, float]:
        return self.norms([p.grad for p in self.params])

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the weights, to measure the next update against.

        Copied into the same buffers each time: allocating fresh ones costs page faults on every
        byte (measured at 12M parameters: 33 ms a clone, against a few ms a copy into warm memory).
        """
        with torch.no_grad():
            current = [p.detach() for p in self.local_params()]
            if self._buffers is None or any(b.shape != p.shape or b.dtype != p.dtype or b.device != p.device
                                            for b, p in zip(self._buffers, current)):
                self._buffers = [p.clone() for p in current]
            else:
                torchcompat.foreach_copy_(self._buffers, current)
            return self._buffers

    def update_ratios(self, before: list[torch.Tensor]) -> dict[str, float]:
        """{layer: ||W - W_before|| / ||W_before||}; consumes ``before`` (overwritten in place)."""
        old = self.norms(before)
        with torch.no_grad():
            torchcompat.foreach_sub_(before, [p.detach() for p in self.local_params()])
        change = self.norms(before)
        return {name: change[name] / old[name] for name in change if old.get(name)}

    def checksums(self) -> dict[str, int]:
        """{layer: exact checksum of its weights' bits}: equal on replicas iff (almost surely) equal weights.

        Integer sums of the raw bits: no rounding, so bit-identical replicas agree exactly and a
        changed weight shows (but for a 1 in 2^32 chance). Overflow wraps the same way on every rank.
        """
        if not self.params:
            return {}
        with torch.no_grad():
            sums = []
            for p in self.local_params():
                view, acc = _BITS[p.element_size()]
                sums.append(p.detach().view(view).sum(dtype=acc).to(torch.int64))
            totals = self._combine(_stack_cpu(sums), list(range(len(self.params))), torch.int64)
        return {name: int(totals[i]) for i, name in enumerate(self.names)}


def _is_sharded(param: torch.Tensor) -> bool:
    placements = getattr(param, "placements", None)  # a DTensor's; plain tensors have none
    if not placements:
        return False
    return any(getattr(p, "is_shard", lambda: False)() for p in placements)


def _stack_cpu(values: Sequence[torch.Tensor]) -> torch.Tensor:
    try:
        return torch.stack(list(values)).cpu()
    except RuntimeError:  # parameters on several devices (model parallel): gather one by one
        return torch.stack([v.cpu() for v in values])
