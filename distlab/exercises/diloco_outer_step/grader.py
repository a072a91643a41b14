"""Grader of ``diloco-outer-step``: the ranks' models averaged, the change stepped by an outer optimizer.

Each case builds the same small model on every rank (one seed) and its anchor (a copy of the
weights) with an outer SGD (Nesterov momentum 0.9, the case's learning rate) over the anchor. Three
outer steps follow; before each, every rank moves its model by a change of its own, drawn from the
case's seed and the rank (what its inner steps would do), so that the grader knows every rank's
model without asking. After each of the learner's outer steps the anchor and the model must equal
DiLoCo's, computed here on one process: the mean of the ranks' models, ``anchor - mean`` as the
anchor's gradient, the same SGD stepped, the model set to the anchor.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TypedDict

import torch
import torch.distributed as dist
from torch import nn

from ...rank.exercise import Learner, failed, first_difference, passed

_CLOSE = {"rtol": 1e-5, "atol": 1e-6}
_STEPS = 3
_KINDS = (("the paper's lr 0.7", 0.7), ("lr 1", 1.0), ("lr 0.3", 0.3))


class Case(TypedDict):
    name: str
    lr: float
    width: int
    seed: int


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
    for kind, lr in _KINDS:
        width = rng.randrange(2, 9)
        out.append({"name": f"{kind}, width {width}, {_STEPS} outer steps", "lr": lr, "width": width,
                    "seed": rng.randrange(2**31)})
    return out


def _model(case: Case) -> nn.Module:
    torch.manual_seed(case["seed"])
    return nn.Sequential(nn.Linear(4, case["width"]), nn.Tanh(), nn.Linear(case["width"], 2))


def _outer(anchor: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(anchor, lr=lr, momentum=0.9, nesterov=True)


def _change(case: Case, step: int, rank: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(case["seed"] + 1000 * step + rank + 1)
    return [0.1 * torch.randn(shape, generator=gen) for shape in shapes]


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(case)
    anchor = [p.detach().clone() for p in model.parameters()]
    outer_opt = _outer(anchor, case["lr"])
    # DiLoCo on one process, from every rank's changes
    ref = [p.detach().clone() for p in model.parameters()]
    ref_opt = _outer(ref, case["lr"])
    shapes = [p.shape for p in model.parameters()]
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    for step in range(1, _STEPS + 1):
        with torch.no_grad():
            for p, d in zip(model.parameters(), _change(case, step, rank, shapes)):
                p.add_(d)
            changes = [_change(case, step, r, shapes) for r in range(world)]
            means = [a + sum(c[i] for c in changes) / world for i, a in enumerate(ref)]
            plain = [m.clone() for m in means]
            for a, m in zip(ref, means):
                a.grad = a - m
        before = [a.clone() for a in ref]
        ref_opt.step()
        learner["outer_step"](model, anchor, outer_opt)
        if any(p is not q for p, q in zip(model.parameters(), params)):
            return failed(f"outer step {step}: the model's parameters were replaced: copy the anchor into them")
        for name, p, a, expected, mean, start in zip(names, model.parameters(), anchor, ref, plain, before):
            wrong = first_difference(a.detach(), expected, **_CLOSE)
            if wrong is not None:
                why = _why(a.detach(), expected, mean, start)
                return failed(f"outer step {step}: the anchor of `{name}` {why} (first difference at {wrong})")
            if first_difference(p.detach(), expected, **_CLOSE) is not None:
                return failed(f"outer step {step}: the anchor is right, but `{name}` in the model is not the "
                              "new anchor: copy it into the model's parameters")
    return passed(f"{_STEPS} outer steps, as DiLoCo's on one process")


def _why(got: torch.Tensor, expected: torch.Tensor, mean: torch.Tensor, start: torch.Tensor) -> str:
    """What the learner's anchor looks like, in words."""
    if first_difference(got, start, **_CLOSE) is None:
        return "did not change: set each anchor tensor's .grad, then step the outer optimizer"
    if first_difference(got, mean, **_CLOSE) is None:
        return ("is the plain average of the models: that is local SGD; DiLoCo steps the outer optimizer on "
                "the gradient anchor - average")
    if first_difference(got, 2 * start - expected, rtol=1e-4, atol=1e-5) is None:
        return "moved away from the average: the outer gradient is anchor - average, not average - anchor"
    return "differs from DiLoCo's: check the average (a sum over the ranks divided by the world size)"
