"""Grader of ``tensor-parallel-mlp``: Megatron-LM's MLP split by hand, one all-reduce forward, one backward.

Every rank draws the same full weights of ``y = gelu(x @ w1.T + b1) @ w2.T + b2`` and the same input
and output gradient (one seed), gives the learner's ``TPMLP`` the full weights, and runs its forward
and backward with ``dist.all_reduce`` counted. The reference is the unsplit MLP in this process: the
output and the input's gradient must equal it, each shard's gradient the matching slice of it, within
float rounding (the hidden features are summed in another order); the all-reduces must be exactly one
in forward and one in backward.
"""

from __future__ import annotations

import functools
import operator
import random
from collections.abc import Callable, Mapping
from typing import ParamSpec, TypedDict, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...rank.exercise import Learner, Tolerance, backward, failed, first_difference, grad_of, passed

P = ParamSpec("P")
R = TypeVar("R")

_KINDS = (
    ("2-D input", "float32"),
    ("3-D input", "float32"),
    ("2-D input", "float64"),
    ("wide hidden layer", "float32"),
)


class Case(TypedDict):
    name: str
    dtype: str  # a torch dtype's name: "float32"
    d: int  # the model's width
    hidden: int
    shape: list[int]  # the input's
    seed: int


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
    for kind, dtype in _KINDS:
        d = rng.randrange(3, 21)  # any d: only hidden is split
        per_rank = rng.randrange(8, 17) if kind == "wide hidden layer" else rng.randrange(1, 7)
        hidden = per_rank * world_size
        shape = [rng.randrange(1, 6), rng.randrange(2, 5), d] if kind == "3-D input" else [rng.randrange(1, 8), d]
        out.append(
            {
                "name": f"{kind}, x {tuple(shape)}, hidden {hidden}, {dtype}",
                "dtype": dtype,
                "d": d,
                "hidden": hidden,
                "shape": shape,
                "seed": rng.randrange(2**31),
            }
        )
    return out


def _counting(count: Callable[[], None], real: Callable[P, R]) -> Callable[P, R]:
    """``real``, calling ``count()`` first at each call."""

    def counted(*args: P.args, **kwargs: P.kwargs) -> R:
        count()
        return real(*args, **kwargs)

    return counted


def _mlp(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | float
) -> torch.Tensor:
    return F.gelu(x @ w1.T + b1) @ w2.T + b2


def _shard_problem(model: object, shards: dict[str, torch.Tensor], r: int, k: int, tol: Tolerance) -> str | None:
    """What is wrong with the shards the learner kept on this rank, in words (None if right)."""
    where = (
        f"rank {r} keeps rows {r * k}:{(r + 1) * k} of w1 and b1, columns {r * k}:{(r + 1) * k} of w2, and all of b2"
    )
    for name, want in shards.items():
        got = getattr(model, name, None)
        if not isinstance(got, torch.Tensor):
            return (
                f"TPMLP has no tensor `self.{name}`: keep this rank's shard as "
                f"`self.{name} = torch.nn.Parameter(...)` ({where})"
            )
        if tuple(got.shape) != tuple(want.shape):
            if name == "w2" and got.dim() == 2 and got.shape[0] < want.shape[0]:
                return (
                    f"`w2` has shape {tuple(got.shape)}, expected {tuple(want.shape)}: w2 is split by rows; "
                    f"the row-parallel layer splits w2's COLUMNS, w2[:, {r * k}:{(r + 1) * k}] on rank {r}, "
                    "the ones that multiply this rank's part of the hidden layer"
                )
            if name == "b2" and got.shape[0] < want.shape[0]:
                return (
                    f"`b2` has shape {tuple(got.shape)}, expected {tuple(want.shape)}: b2 is not split, every rank "
                    "keeps all of it (and adds it once, after the all-reduce)"
                )
            return f"`{name}` has shape {tuple(got.shape)}, expected {tuple(want.shape)} ({where})"
        if not got.requires_grad:
            return f"`{name}` does not require a gradient: make it a torch.nn.Parameter"
        if got.dtype != want.dtype:
            return f"`{name}` has dtype {got.dtype}, expected {want.dtype}: keep the weights' dtype"
        wrong = first_difference(got.detach(), want, **tol)
        if wrong is not None:
            return f"`{name}` is not this rank's shard of the full {name} ({where}): {wrong}"
    return None


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    dtype = getattr(torch, case["dtype"])
    n, r = dist.get_world_size(), dist.get_rank()
    d, hidden = case["d"], case["hidden"]
    k = hidden // n
    rows = slice(r * k, (r + 1) * k)
    gen = torch.Generator().manual_seed(case["seed"])  # the same on every rank

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    w1, b1 = draw(hidden, d, scale=d**-0.5), draw(hidden, scale=0.5)
    w2, b2 = draw(d, hidden, scale=hidden**-0.5), draw(d) + 1.0  # b2 far from 0: added N times shows
    x = draw(*case["shape"])
    grad_y = draw(*case["shape"][:-1], d)
    tol: Tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}

    # The unsplit MLP, in this process.
    full = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    y_ref = _mlp(*full)
    backward(y_ref, grad_y)
    gx_ref, gw1_ref, gb1_ref, gw2_ref, gb2_ref = (grad_of(t) for t in full)
    # This rank's part alone, as a rank computes it before any all-reduce.
    mine = [t.clone().requires_grad_() for t in (x, w1[rows], b1[rows], w2[:, rows])]
    partial = _mlp(mine[0], mine[1], mine[2], mine[3], 0.0)
    backward(partial, grad_y)
    gx_partial = mine[0].grad

    model = learner["TPMLP"](w1.clone(), b1.clone(), w2.clone(), b2.clone())
    shards = {"w1": w1[rows], "b1": b1[rows], "w2": w2[:, rows], "b2": b2}
    problem = _shard_problem(model, shards, r, k, tol)
    # The grader's own collectives, on every rank whatever this rank found: no rank may leave one waiting.
    bad = torch.tensor([problem is not None], dtype=torch.int64)
    dist.all_reduce(bad)
    if bad.item():
        return failed(problem) if problem else passed("this rank's shards are right; another rank's are not")

    counts = {"forward": 0, "backward": 0}
    phase = "forward"
    all_reduce = dist.all_reduce

    def count() -> None:
        counts[phase] += 1

    counted = _counting(count, all_reduce)

    x_in = x.clone().requires_grad_()
    dist.all_reduce = counted
    try:
        y = model(x_in)
    finally:
        dist.all_reduce = all_reduce
    unusable = _unusable(y, y_ref)
    bad = torch.tensor([unusable is not None], dtype=torch.int64)
    dist.all_reduce(bad)  # backward all-reduces: every rank runs it, or none
    if bad.item():
        return failed(unusable) if unusable else passed("this rank's output is usable; another rank's is not")

    phase = "backward"
    dist.all_reduce = counted
    try:
        y.backward(grad_y)
    finally:
        dist.all_reduce = all_reduce
    measured = {"all_reduce_forward": counts["forward"], "all_reduce_backward": counts["backward"]}

    # Everything below is local to this rank.
    if first_difference(y, y_ref, **tol) is not None:
        return failed(_output_mistake(y, y_ref, x, w1, b1, w2, b2, partial, rows, n, k, tol), **measured)
    if counts["forward"] != 1:
        return failed(
            f"the output is right, but forward made {counts['forward']} calls to dist.all_reduce, expected exactly 1: "
            "only the partial sums after the second matmul need summing (Megatron's g)",
            **measured,
        )
    gradients = (
        ("x", x_in.grad, gx_ref),
        ("w1", model.w1.grad, gw1_ref[rows]),
        ("b1", model.b1.grad, gb1_ref[rows]),
        ("w2", model.w2.grad, gw2_ref[:, rows]),
        ("b2", model.b2.grad, gb2_ref),
    )
    for name, got, want in gradients:
        if got is None:
            return failed(f"`{name}` has no gradient after backward: its path to the output left autograd", **measured)
        wrong = first_difference(got, want, **tol)
        if wrong is None:
            continue
        if first_difference(got, want * n, **tol) is None:
            return failed(
                f"`{name}`'s gradient is {n} times the reference's: the forward all-reduce's backward must pass the "
                "gradient through unchanged, since every rank already holds the whole gradient of the output "
                "(torch.distributed.nn.functional.all_reduce all-reduces in backward too)",
                **measured,
            )
        if name == "x" and first_difference(got, gx_partial, **tol) is None:
            return failed(
                "the input's gradient is only this rank's part: all-reduce it in backward (Megatron's f: the "
                "identity in forward, an all-reduce of the gradient in backward)",
                **measured,
            )
        return failed(f"`{name}`'s gradient differs from the reference's slice at {wrong}", **measured)
    if counts["backward"] != 1:
        return failed(
            f"the gradients are right, but backward made {counts['backward']} calls to dist.all_reduce, expected "
            "exactly 1: only the input's gradient needs summing (Megatron's f)",
            **measured,
        )
    return passed(**measured)


def _unusable(y: object, y_ref: torch.Tensor) -> str | None:
    """Why backward cannot run on the learner's output (None if it can)."""
    if not isinstance(y, torch.Tensor):
        return f"forward returned a {type(y).__name__}, expected a tensor"
    if tuple(y.shape) != tuple(y_ref.shape) or y.dtype != y_ref.dtype:
        return f"forward returned shape {tuple(y.shape)} {y.dtype}, expected {tuple(y_ref.shape)} {y_ref.dtype}"
    if not y.requires_grad:
        return (
            "the output does not require a gradient: keep the computation (and your autograd Functions) inside "
            "autograd, with no .detach() or torch.no_grad()"
        )
    return None


def _output_mistake(
    y: torch.Tensor,
    y_ref: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    partial: torch.Tensor,
    rows: slice,
    n: int,
    k: int,
    tol: Tolerance,
) -> str:
    """The likely mistake behind a wrong output, in words."""
    y = y.detach()
    if first_difference(y, y_ref.detach() + (n - 1) * b2, **tol) is None:
        return (
            f"the output counts b2 {n} times: every rank adds b2 before the all-reduce; add it once, after the "
            "all-reduce (or on one rank only)"
        )
    if first_difference(y, partial.detach() + b2, **tol) is None:
        return (
            "the output is only this rank's partial sum: all-reduce the second matmul's output across the ranks "
            "(Megatron's g), then add b2"
        )
    blocks = [slice(s * k, (s + 1) * k) for s in range(n)]
    with torch.no_grad():
        # Summed as sum() would, without its 0 to start from (the blocks are never none).
        after_gelu = functools.reduce(operator.add, (F.gelu(x @ w1[b].T + b1[b]) for b in blocks)) @ w2[:, rows].T + b2
        before_gelu = F.gelu(functools.reduce(operator.add, (x @ w1[b].T + b1[b] for b in blocks))) @ w2[:, rows].T + b2
    if any(first_difference(y, wrong, **tol) is None for wrong in (after_gelu, before_gelu)):
        return (
            "the all-reduce is in the wrong place: it sums the hidden layer, whose slices hold different features "
            "on each rank; keep the hidden slice local and all-reduce the output of the second matmul"
        )
    return f"the output differs from the unsplit MLP's at {first_difference(y, y_ref, **tol)}"
