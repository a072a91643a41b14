"""Grader of ``expert-dispatch``: a mixture-of-experts layer's dispatch and combine, by two all-to-alls.

Every rank's tokens and routing are made from the case's seed and the rank, so each rank can make all
of them; every expert is a small MLP made from the case's seed and its index, so each rank can make
them all too. The reference is one process's layer: for this rank's tokens, the first ``capacity``
routed to each expert get that expert's output, the rest zeros. The learner's ``moe_forward`` runs
under a dispatch mode that records each collective it makes and its size (whatever API called it:
``dist.all_to_all_single``, the list form, the functional collectives). A wrong output is explained
by comparing it with the layer's usual mistakes: no capacity, the capacity counted over all experts,
results put back in the wrong rows, tokens sent to the wrong expert.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import TypedDict, cast

import torch
import torch.distributed as dist
from torch import nn

from ...rank import torchcompat_dispatch
from ...rank.collective_ops import collective_name
from ...rank.exercise import Learner, Tolerance, failed, first_difference, passed

_TOL: Tolerance = {"rtol": 1e-5, "atol": 1e-6}


class Case(TypedDict):
    name: str
    tokens: int  # per rank
    capacity: int  # per expert
    skew: float  # the share of tokens routed to expert 0 whatever their draw
    dim: int
    seed: int


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
    # (name, tokens, capacity as a share of tokens / experts, skew): the plain case first.
    shapes = (
        ("even routing, room for every token", rng.randrange(8, 17), 4.0, 0.0),
        ("skewed routing, small capacity", rng.randrange(16, 41), 1.0, 0.7),
        ("one slot per expert", rng.randrange(5, 13), None, 0.5),
        ("every token to expert 0", rng.randrange(6, 15), 1.25, 1.0),
    )
    for name, tokens, factor, skew in shapes:
        capacity = 1 if factor is None else max(1, int(factor * tokens / world_size))
        dim, case_seed = rng.randrange(3, 9), rng.randrange(2**31)
        out.append(
            {
                "tokens": tokens,
                "capacity": capacity,
                "skew": skew,
                "dim": dim,
                "seed": case_seed,
                "name": f"{name}: {tokens} tokens per rank, capacity {capacity}",
            }
        )
    return out


def _inputs(case: Case, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and their experts: the same on every rank that makes them."""
    gen = torch.Generator().manual_seed(case["seed"] + 7919 * rank)
    x = torch.randn(case["tokens"], case["dim"], generator=gen)
    expert_of = torch.randint(0, world, (case["tokens"],), generator=gen)
    popular = torch.rand(case["tokens"], generator=gen) < case["skew"]
    expert_of[popular] = 0  # a router that favours expert 0: it overflows, others may get nothing
    return x, expert_of


def _expert(case: Case, index: int) -> nn.Module:
    torch.manual_seed(case["seed"] + 104729 * (index + 1))
    return nn.Sequential(nn.Linear(case["dim"], 2 * case["dim"]), nn.Tanh(), nn.Linear(2 * case["dim"], case["dim"]))


def _kept(expert_of: torch.Tensor, capacity: int, world: int) -> torch.Tensor:
    """Whether each token keeps a slot: the first ``capacity`` routed to each expert, in token order."""
    kept = torch.zeros_like(expert_of, dtype=torch.bool)
    for e in range(world):
        kept[(expert_of == e).nonzero().flatten()[:capacity]] = True
    return kept


def _layer(x: torch.Tensor, expert_of: torch.Tensor, kept: torch.Tensor, experts: list[nn.Module]) -> torch.Tensor:
    """One process's layer: each kept token through its expert, every other row zero."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        mine = kept & (expert_of == e)
        if mine.any():
            out[mine] = expert(x[mine])
    return out


class _Collectives(torchcompat_dispatch.DispatchMode):
    """Each collective op run while active, with the bytes of its first tensor argument."""

    def __init__(self) -> None:
        cast("Callable[[], None]", super().__init__)()  # TorchDispatchMode's, unannotated in torch
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(
        self,
        func: torchcompat_dispatch.Op,
        types: tuple[type, ...],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        name = collective_name(func)
        if name is not None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if not tensors:  # the list forms: a list of tensors
                tensors = [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            self.seen.append((name, sum(t.numel() * t.element_size() for t in tensors[:1])))
        return func(*args, **(kwargs or {}))


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, expert_of = _inputs(case, rank, world)
    experts = [_expert(case, e) for e in range(world)]
    capacity = case["capacity"]
    kept = _kept(expert_of, capacity, world)
    with torch.no_grad():
        expected = _layer(x, expert_of, kept, experts)
        recorder = _Collectives()
        with recorder:
            got = learner["moe_forward"](x.clone(), expert_of.clone(), capacity, experts[rank])
    buffer = world * capacity * case["dim"] * 4
    all_to_alls = [size for name, size in recorder.seen if name == "all_to_all"]
    measured = {"dropped": int((~kept).sum()), "all_to_alls": len(all_to_alls), "buffer_bytes": buffer}
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(x.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return failed(f"moe_forward returned {shape}, expected a tensor of this rank's tokens' shape {tuple(x.shape)}",
                      **measured)
    got = got.detach().float()
    wrong = first_difference(got, expected, **_TOL)
    if wrong is not None:
        return failed(_output_mistake(got, expected, x, expert_of, kept, experts, capacity, world, wrong), **measured)
    others = sorted({name for name, _ in recorder.seen if name != "all_to_all"})
    if others:
        return failed(
            f"the output is right, but the layer also ran {', '.join(others)}: send each token only to its expert's "
            "rank, by all-to-all, and the results back the same way (gathering every rank's tokens everywhere moves "
            f"{world} times the bytes)", **measured,
        )
    if len(all_to_alls) != 2:
        return failed(
            f"the output is right, but the layer ran {len(all_to_alls)} all-to-alls, expected 2: one to dispatch "
            "every slot of every expert at once, one to combine", **measured,
        )
    if any(size != buffer for size in all_to_alls):
        return failed(
            f"the all-to-alls moved {all_to_alls} bytes, expected {buffer} each: world_size x capacity rows of "
            f"{case['dim']} float32 numbers, every expert's block capacity rows whatever the tokens routed (padded)",
            **measured,
        )
    return passed(**measured)


def _output_mistake(
    got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, expert_of: torch.Tensor, kept: torch.Tensor,
    experts: list[nn.Module], capacity: int, world: int, wrong: str,
) -> str:
    """The likely mistake behind a wrong output, in words."""
    with torch.no_grad():
        every = _layer(x, expert_of, torch.ones_like(kept), experts)
        overall = torch.zeros_like(kept)
        overall[:capacity] = True
        first_overall = _layer(x, expert_of, overall, experts)
    if not kept.all() and first_difference(got, every, **_TOL) is None:
        return (
            f"{int((~kept).sum())} tokens past their expert's capacity came back with the expert's output: keep only "
            f"the first {capacity} tokens routed to each expert, and leave the rows of the others zero"
        )
    if first_difference(got, first_overall, **_TOL) is None:
        return (
            f"the capacity was counted over all the tokens (the first {capacity} kept, whatever their expert): "
            f"each expert has {capacity} slots of its own"
        )
    rows = [t for t in range(len(x)) if not torch.allclose(got[t], expected[t], **_TOL)]
    t = rows[0]
    if not kept[t]:
        return f"token {t} was dropped (its expert {int(expert_of[t])} was full) but its row is not zero"
    if torch.allclose(got[t], torch.zeros_like(got[t])):
        return f"token {t} kept a slot at expert {int(expert_of[t])} but its row came back zero: {len(rows)} rows wrong"
    with torch.no_grad():
        mine = [expert(x[t : t + 1])[0] for expert in experts]
    for e, out in enumerate(mine):
        if e != int(expert_of[t]) and torch.allclose(got[t], out, **_TOL):
            return (
                f"token {t} went to expert {e}, not its expert {int(expert_of[t])}: block e of the buffer you "
                "dispatch goes to rank e, so put each token in its own expert's block"
            )
    for other in range(len(x)):
        if other != t and kept[other] and torch.allclose(got[t], expected[other], **_TOL):
            return (
                f"row {t} holds token {other}'s result: the combined results were put back in the wrong rows "
                "(row e * capacity + k of what comes back belongs to the token in slot k of expert e)"
            )
    return f"the output differs from one process's layer at {wrong} ({len(rows)} of {len(x)} rows wrong)"
