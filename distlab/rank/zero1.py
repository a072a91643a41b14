"""Megatron-LM's distributed optimizer (ZeRO stage 1) in torch's own collectives: ``Plan(dp="zero1")``.

torch has no such optimizer for a replicated model (``ZeroRedundancyOptimizer`` all-reduces the
gradients and then broadcasts each rank's parameters; FSDP2 shards the parameters too), so its
three steps are written here, as Megatron-LM's ``DistributedOptimizer`` and Rajbhandari et al.
2020 (ZeRO, stage 1) define them:

1. the gradients, in the model's dtype, one contiguous buffer per bucket of ``BUCKET`` elements
   (Megatron's default bucket), are **reduce-scattered** over the data-parallel group: each rank
   receives the sum of its 1/N of every bucket;
2. AdamW steps that 1/N on an fp32 **main copy** of the parameters (the optimizer's states: the
   main copy and the two moments, 12 bytes an element, on 1/N of the elements);
3. the updated 1/N, cast to the model's dtype, is **all-gathered** into every rank's parameters.

Memory per GPU, with bf16 parameters: 2 (parameters) + 2 (gradients) + 12 / N bytes a parameter,
the ZeRO paper's ``(2 + 2 + K/N) Psi``. Traffic: the reduce-scatter and the all-gather together move
what DDP's all-reduce moves, once a step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["BUCKET", "DistributedAdamW"]

#: Elements per bucket (Megatron-LM's ``--ddp-bucket-size`` default: 40 million parameters).
BUCKET = 40_000_000


class DistributedAdamW(torch.optim.AdamW):
    """AdamW over ``params`` (a DTensor's local shard, a plain tensor itself) with its states sharded
    over ``group``: ``step()`` reduce-scatters the gradients, steps this rank's 1/N on fp32, and
    all-gathers the parameters back (see the module). As a ``torch.optim.AdamW`` it holds the fp32
    main copies of its 1/N of each bucket, which are its parameters."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup, **kwargs: float | bool) -> None:
        self.model_params = params
        self.group = group
        self.world = int(group.size())
        self.rank = int(dist.get_rank(group))
        self.locals = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        total = sum(t.numel() for t in self.locals)
        self.buckets = [(start, min(total, start + BUCKET)) for start in range(0, total, BUCKET)]
        mains = []
        with torch.no_grad():
            for start, end in self.buckets:
                share = math.ceil((end - start) / self.world)
                piece = self._flat(start, end, share * self.world, grads=False)
                mains.append(piece[self.rank * share:(self.rank + 1) * share].float().clone())
        super().__init__(mains, **kwargs)  # type: ignore[arg-type]
        self.main = mains
        # AdamW's own step between the two collectives (steps 1 and 3 of the module)
        self.register_step_pre_hook(lambda optimizer, args, kwargs: self._reduce_scatter())
        self.register_step_post_hook(lambda optimizer, args, kwargs: self._all_gather())

    def _flat(self, start: int, end: int, size: int, *, grads: bool) -> torch.Tensor:
        """Elements ``start:end`` of every local parameter (or its gradient) laid end to end in one
        buffer of ``size`` elements, zeros after them (a bucket padded to a multiple of N)."""
        pieces, offset = [], 0
        for p, t in zip(self.model_params, self.locals, strict=True):
            n = t.numel()
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                source = _local_grad(p, t) if grads else t.detach()
                pieces.append(source.reshape(-1)[lo - offset:hi - offset])
            offset += n
        flat = torch.empty(size, dtype=pieces[0].dtype, device=pieces[0].device)
        torch.cat(pieces, out=flat[:end - start])
        flat[end - start:].zero_()
        return flat

    @torch.no_grad()
    def _reduce_scatter(self) -> None:
        for (start, end), main in zip(self.buckets, self.main, strict=True):
            share = main.numel()
            flat = self._flat(start, end, share * self.world, grads=True)
            reduced = torch.empty(share, dtype=flat.dtype, device=flat.device)
            dist.reduce_scatter_tensor(reduced, flat, group=self.group)  # the sum of this rank's 1/N
            main.grad = reduced.float().div_(self.world)  # the mean, as DDP's all-reduce leaves it

    @torch.no_grad()
    def _all_gather(self) -> None:
        dtype = self.locals[0].dtype
        for (start, end), main in zip(self.buckets, self.main, strict=True):
            gathered = torch.empty(main.numel() * self.world, dtype=dtype, device=main.device)
            dist.all_gather_into_tensor(gathered, main.to(dtype), group=self.group)
            offset = 0
            for t in self.locals:
                n = t.numel()
                lo, hi = max(start, offset), min(end, offset + n)
                if lo < hi:
                    t.view(-1)[lo - offset:hi - offset].copy_(gathered[lo - start:hi - start])
                offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """What the optimizer holds: the fp32 main copy of this rank's 1/N and AdamW's moments of it."""
        moments = [t for s in self.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*self.main, *moments]


def _local_grad(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    grad = p.grad
    if grad is None:
        return torch.zeros_like(local)
    return grad.to_local() if isinstance(grad, DTensor) else grad
