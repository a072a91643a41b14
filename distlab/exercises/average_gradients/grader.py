"""Grader of ``average-gradients``: after backward, the learner averages every gradient across ranks, as DDP does.

Each case builds the same model on every rank (one seed), gives each rank its own batch, and compares
the learner's gradients with those of ``DistributedDataParallel`` on a copy of the model fed the same
batch: equal within float rounding (the sums may be added in another order). Each ``p.grad`` must
then still be the tensor backward made, in the memory it had: averaged in place, as DDP does.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TypedDict

import torch
import torch.distributed as dist
from torch import nn

from ...rank.exercise import Learner, backward, failed, first_difference, passed

_SHAPES = (
    ("mlp", torch.float32),
    ("frozen first layer", torch.float32),
    ("mlp", torch.float64),
    ("deep", torch.float32),
)


class Case(TypedDict):
    name: str
    kind: str  # "mlp", "frozen first layer" or "deep"
    dtype: str  # a torch dtype's name: "float32"
    width: int
    batch: int
    seed: int


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
    for kind, dtype in _SHAPES:
        width, batch = rng.randrange(3, 17), rng.randrange(1, 9)
        out.append(
            {
                "name": f"{kind}, width {width}, batch {batch}, {str(dtype).removeprefix('torch.')}",
                "kind": kind,
                "dtype": str(dtype).removeprefix("torch."),
                "width": width,
                "batch": batch,
                "seed": rng.randrange(2**31),
            }
        )
    return out


def _model(case: Case) -> nn.Module:
    torch.manual_seed(case["seed"])
    w = case["width"]
    layers: list[nn.Module] = [nn.Linear(5, w), nn.Tanh(), nn.Linear(w, 3)]
    if case["kind"] == "deep":
        layers[2:2] = [nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w, bias=False), nn.Tanh()]
    model = nn.Sequential(*layers).to(getattr(torch, case["dtype"]))
    if case["kind"] == "frozen first layer":
        for p in model[0].parameters():
            p.requires_grad_(False)
    return model


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    dtype = getattr(torch, case["dtype"])
    model = _model(case)
    reference = nn.parallel.DistributedDataParallel(_model(case))
    gen = torch.Generator().manual_seed(case["seed"] + 1 + dist.get_rank())
    x = torch.randn(case["batch"], 5, generator=gen, dtype=dtype)
    y = torch.randn(case["batch"], 3, generator=gen, dtype=dtype)

    backward(nn.functional.mse_loss(reference(x), y))
    backward(nn.functional.mse_loss(model(x), y))
    local = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    # The tensors backward made, and their memory. DDP averages them in place (its buckets are views of
    # them), and so must this: an optimizer or a hook holding p.grad keeps that object. Both held here
    # (`.data = ...` would swap the memory under the same object), the memory cannot be reused by a new
    # tensor, so the same address after the call is the same memory.
    made = {name: (p.grad, p.grad.untyped_storage()) for name, p in model.named_parameters() if p.grad is not None}
    learner["average_gradients"](model)

    world = dist.get_world_size()
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    for (name, p), (_, q) in zip(model.named_parameters(), reference.module.named_parameters()):
        if q.grad is None:
            if p.grad is not None:
                return failed(f"`{name}` does not require a gradient, yet has one after average_gradients")
            continue
        if p.grad is None:
            return failed(f"`{name}`'s gradient is gone (None) after average_gradients")
        wrong = first_difference(p.grad, q.grad, **tol)
        if wrong is None:
            replaced = _replaced(p.grad, *made[name])
            if replaced:
                return failed(f"`{name}`'s gradient holds the mean, but {replaced}")
            continue
        if first_difference(p.grad, q.grad * world, **tol) is None:
            return failed(
                f"`{name}`'s gradient is {world} times DDP's, the sum over the ranks, not the mean: "
                "divide by the world size after the all-reduce"
            )
        if first_difference(p.grad, local[name], **tol) is None:
            return failed(f"`{name}`'s gradient is this rank's own, unchanged: it was not reduced across ranks")
        if first_difference(p.grad * world, local[name], **tol) is None:
            return failed(
                f"`{name}`'s gradient is this rank's own divided by {world}: it was not reduced "
                "across ranks (all-reduce, then divide)"
            )
        return failed(f"`{name}`'s gradient differs from DDP's at {wrong}")
    return passed()


_KEEP_IT = (
    "DDP's buckets, an optimizer or a hook may hold the tensor backward made, and that tensor must be the one "
    "averaged: all-reduce `p.grad` itself and divide it in place (`/=`), as the task asks"
)


def _replaced(now: torch.Tensor, made: torch.Tensor, memory: torch.UntypedStorage) -> str | None:
    """How ``p.grad`` stopped being the tensor backward made, in the memory it had; None if it did not."""
    same_memory = now.untyped_storage().data_ptr() == memory.data_ptr()
    if now is made:
        return None if same_memory else f"in new memory put under the same tensor (`p.grad.data = ...`): {_KEEP_IT}"
    if same_memory:
        return f"in a new tensor object over the old memory, assigned to `.grad` (`p.grad = ...`): {_KEEP_IT}"
    return f"in a new tensor assigned to `.grad` (`p.grad = ...`): {_KEEP_IT}"
