"""Grader of ``diverged-replicas``: the names of the parameters whose replicas differ, found on every rank.

Each case builds the same model on every rank (one seed), then changes some of its parameters on
some ranks: one element moved by one unit in its last place, or two elements swapped (the same sum,
the same norm), or a whole parameter rescaled. The learner's list must be the sorted names of exactly
the parameters changed, and the same on every rank.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TypedDict

import torch
import torch.distributed as dist
from torch import nn

from ...rank.exercise import Learner, failed, passed

_HOW = {"ulp": "one element moved by one unit in its last place", "swap": "two of its elements swapped",
        "scaled": "all of it scaled by 1.5"}


class Change(TypedDict):
    parameter: int  # index in model.named_parameters()
    rank: int
    how: str  # a key of _HOW


class Case(TypedDict):
    name: str
    dtype: str
    width: int
    seed: int
    changes: list[Change]


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    last = world_size - 1
    out: list[Case] = []
    three = zip(rng.sample(range(6), 3), ("ulp", "swap", "scaled"))
    plans: tuple[tuple[str, str, list[tuple[int, int, str]]], ...] = (
        ("all replicas equal", "float32", []),
        ("one element one ulp apart on the last rank", "float32", [(rng.randrange(6), last, "ulp")]),
        ("two elements swapped on rank 1", "float64", [(rng.choice([0, 2, 4]), 1, "swap")]),
        ("three parameters apart on different ranks", "float32",
         [(i, rng.randrange(1, world_size), how) for i, how in three]),
    )
    for title, dtype, changes in plans:
        out.append({"name": f"{title}, {dtype}", "dtype": dtype, "width": rng.randrange(3, 9),
                    "seed": rng.randrange(2**31),
                    "changes": [{"parameter": p, "rank": r, "how": how} for p, r, how in changes]})
    return out


def _model(case: Case) -> nn.Module:
    torch.manual_seed(case["seed"])
    w = case["width"]
    model = nn.Sequential(nn.Linear(4, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 2))
    return model.to(getattr(torch, case["dtype"]))


def _change(p: torch.Tensor, how: str) -> None:
    flat = p.detach().view(-1)
    with torch.no_grad():
        if how == "ulp":
            flat[0] = torch.nextafter(flat[0], flat[0] + 1)
        elif how == "swap":
            first, second = flat[0].clone(), flat[1].clone()
            flat[0], flat[1] = second, first
        else:
            flat.mul_(1.5)


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    model = _model(case)
    names = [name for name, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    for change in case["changes"]:
        if change["rank"] == dist.get_rank():
            _change(params[change["parameter"]], change["how"])
    expected = sorted({names[c["parameter"]] for c in case["changes"]})

    got = learner["diverged"](model)
    lists: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, got if isinstance(got, (list, tuple)) else None)
    if not isinstance(got, (list, tuple)) or not all(isinstance(n, str) for n in got):
        return failed(f"diverged returned {type(got).__name__} {got!r:.60}: return a list of parameter names")
    if any(other != got for other in lists):
        shown = "; ".join(f"rank {r}: {other!r}" for r, other in enumerate(lists))
        return failed(f"the ranks returned different lists ({shown}): every rank must see every rank's fingerprints")
    if list(got) == expected:
        return passed(f"found {len(expected)} of {len(names)}", found=len(expected))
    missed = [name for name in expected if name not in got]
    if missed:
        change = next(c for c in case["changes"] if names[c["parameter"]] == missed[0])
        said = (f"missed `{missed[0]}`, which has {_HOW[change['how']]} on rank {change['rank']}: "
                f"returned {list(got)!r}")
        if change["how"] == "swap":
            return failed(f"{said}; a sum or a norm does not see where each value is")
        if change["how"] == "ulp":
            return failed(f"{said}; compare bit for bit, not within a tolerance, and every rank's fingerprints, "
                          "not this rank's alone")
        return failed(f"{said}; compare every rank's fingerprints, not this rank's alone")
    extra = [name for name in got if name not in expected]
    if extra:
        return failed(f"returned `{extra[0]}`, which is equal on every rank: returned {list(got)!r}, "
                      f"expected {expected!r}")
    return failed(f"returned {list(got)!r}: the names are right but not sorted ({expected!r})")
