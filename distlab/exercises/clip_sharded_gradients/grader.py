"""Grader of ``clip-sharded-gradients``: clip an FSDP2-sharded model's gradients by the whole gradient's norm.

Each case builds the same MLP on every rank (one seed), shards each layer and the model with
``fully_shard`` over the world, backpropagates each rank's own batch, and keeps the whole gradient
(gathered by the grader, before the learner's call) and its norm. ``max_norm`` is a fraction of that
norm: below 1 the gradients must be scaled by ``max_norm / (norm + 1e-6)``, above 1 left alone. The
norm the learner returns must be the whole gradient's, on every rank, and the gradients afterwards,
gathered again, what clipping gives.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ...rank.exercise import Learner, backward, failed, first_difference, passed

_EPS = 1e-6
_RTOL = 1e-4  # the returned norm against the grader's (float64 sums against float32 ones)
_CLOSE = {"rtol": 1e-5, "atol": 1e-8}  # the gradients, float32
_KINDS = (
    ("clipped", 0.3, False),
    ("under the bound", 3.0, False),
    ("clipped hard", 0.01, False),
    ("a frozen first layer, clipped", 0.5, True),
)


class Case(TypedDict):
    name: str
    ratio: float  # max_norm over the whole gradient's norm
    frozen: bool
    widths: list[int]
    batch: int
    seed: int


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
    for kind, ratio, frozen in _KINDS:
        widths = [rng.randrange(3, 13), rng.randrange(3, 13)]
        batch = rng.randrange(2, 9)
        out.append({
            "name": f"{kind} (max_norm {ratio:g} x the norm), widths {widths[0]} and {widths[1]}, batch {batch}",
            "ratio": ratio, "frozen": frozen, "widths": widths, "batch": batch, "seed": rng.randrange(2**31),
        })
    return out


def _model(case: Case) -> nn.Sequential:
    torch.manual_seed(case["seed"])
    a, b = case["widths"]
    model = nn.Sequential(nn.Linear(5, a), nn.Tanh(), nn.Linear(a, b), nn.Tanh(), nn.Linear(b, 3))
    if case["frozen"]:
        for p in model[0].parameters():
            p.requires_grad_(False)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _whole(grad: torch.Tensor) -> torch.Tensor:
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def _as_number(value: object) -> float | None:
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    model = _model(case)
    gen = torch.Generator().manual_seed(case["seed"] + 1 + dist.get_rank())
    x, y = torch.randn(case["batch"], 5, generator=gen), torch.randn(case["batch"], 3, generator=gen)
    backward(nn.functional.mse_loss(model(x), y))
    before = {name: _whole(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in before.values()))
    max_norm = case["ratio"] * norm

    returned = learner["clip_grad_norm"](model, max_norm)
    got = _as_number(returned)
    said: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(said, got)
    if got is None:
        return failed(f"clip_grad_norm returned {type(returned).__name__} {returned!r:.60}, not the norm: return "
                      "the whole gradient's norm as a number")
    numbers = [v for v in said if v is not None]
    if len(numbers) < len(said):
        return failed("another rank's clip_grad_norm returned no number: every rank returns the norm")
    if max(numbers) - min(numbers) > _RTOL * norm:
        shown = ", ".join(f"rank {r}: {v:.6g}" for r, v in enumerate(numbers))
        return failed(f"the ranks returned different norms ({shown}): each took its own shard's; the norm is "
                      "the whole gradient's, its squares summed over the ranks", norm=norm)
    if abs(got - norm) > _RTOL * norm:
        if abs(got - norm**2) <= _RTOL * norm**2:
            why = "the sum of the squares, without its square root"
        elif got > norm:
            why = "more than the whole gradient's norm: norms do not add, their squares do"
        else:
            why = "less than the whole gradient's norm: the squares of every shard of every parameter count"
        return failed(f"returned {got:.6g}; the whole gradient's norm is {norm:.6g}: {why}", norm=norm)

    scale = min(1.0, max_norm / (norm + _EPS))
    for name, p in model.named_parameters():
        if name not in before:
            if p.grad is not None:
                return failed(f"`{name}` is frozen, yet has a gradient after clip_grad_norm")
            continue
        if p.grad is None:
            return failed(f"`{name}`'s gradient is gone (None) after clip_grad_norm")
        after = _whole(p.grad)
        wrong = first_difference(after, before[name] * scale, **_CLOSE)
        if wrong is None:
            continue
        if first_difference(after, before[name], **_CLOSE) is None:
            return failed(f"the norm {norm:.6g} is over max_norm {max_norm:.6g}, yet `{name}`'s gradient is "
                          "unchanged: scale the shards in place (the DTensor's `to_local()` is a view)")
        if scale == 1.0 and first_difference(after, before[name] * max_norm / norm, rtol=1e-4, atol=1e-8) is None:
            return failed(f"the norm {norm:.6g} is under max_norm {max_norm:.6g}, so the gradients stay as they "
                          "are; clipping only ever scales down")
        return failed(f"`{name}`'s gradient differs from clipping's (scaled by {scale:.6g}) at {wrong}")
    return passed(f"norm {norm:.4g}, scaled by {scale:.4g}", norm=norm, scale=scale)
