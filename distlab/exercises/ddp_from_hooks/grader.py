"""Grader of ``ddp-from-hooks``: DDP built from gradient hooks, buckets and asynchronous all-reduce.

Each case builds the same model on every rank (one seed), wraps one copy in the learner's
``HookDDP(model, bucket_cap_bytes)`` and another in ``DistributedDataParallel``, and runs 2 or 3
steps, each rank on its own batch: forward, ``loss.backward()``, ``finish()``. After every step the
learner's gradients must equal DDP's within float rounding. Both copies then take the same SGD step
from DDP's gradients (so a wrong step does not spoil the next one's comparison) and their gradients
are zeroed, alternately to None and in place.

While the learner's backward and ``finish()`` run, the grader watches them (``backward_watch.py``): the
gradients as they become ready, each ``dist.all_reduce`` (how many gradients were ready when it was
launched, asynchronous or not, how many elements) and every wait on one before backward returned.
Graded from that order, not from a clock (it holds on a loaded machine): each gradient reduced once
a step, asynchronously, never waited on inside backward (that blocks backward until the all-reduce
is done: no overlap), and each bucket launched from the hook that fills it, where DDP's rule closes
a bucket once it holds at least ``bucket_cap_bytes`` of gradients taken in the order they become
ready; a full bucket left waiting while backward goes on to the next gradient fails. Shown beside
each case: the share of the gradient bytes launched while backward still had gradients to compute,
and DDP's buckets' share. The grader's own collectives (DDP's) are the same on every rank whatever
the learner's result: every step runs on every rank, and the first problem is returned at the end.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import TypedDict, cast

import torch
import torch.distributed as dist
from torch import nn

from ...rank.exercise import Learner, backward, failed, first_difference, passed
from .backward_watch import Late, Launch, Watch

# (kind, bucket cap: "tiny" smaller than any parameter, "mid" about a third of the model, "huge" one bucket)
_KINDS = (
    ("mlp", "tiny", "float32"),
    ("deep", "mid", "float32"),
    ("deep, frozen first layer", "mid", "float32"),
    ("deep", "huge", "float64"),
)

_HUGE_CAP = 25 * 2**20  # DDP's default bucket size: more than any model here


class _Model(TypedDict):
    """What a case's model is made from."""

    kind: str  # "mlp", "deep" or "deep, frozen first layer"
    dtype: str  # a torch dtype's name: "float32"
    width: int
    seed: int


class Case(_Model):
    name: str
    batch: int
    steps: int
    cap: int  # bucket_cap_bytes


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
    for kind, cap_kind, dtype in _KINDS:
        width, batch, steps = rng.randrange(4, 17), rng.randrange(1, 9), rng.choice((2, 3))
        model: _Model = {"kind": kind, "dtype": dtype, "width": width, "seed": rng.randrange(2**31)}
        sizes = _sizes(model)
        if cap_kind == "tiny":
            cap = rng.randrange(1, min(sizes))
        elif cap_kind == "mid":  # a cap that groups several gradients and still makes several buckets
            cap = rng.randrange(min(sizes) + 1, sum(sizes) // 2)
            while not 2 <= _expected(sizes, cap) < len(sizes):
                cap = rng.randrange(min(sizes) + 1, sum(sizes) // 2)
        else:
            cap = _HUGE_CAP
        buckets = _expected(sizes, cap)
        name = (
            f"{kind}, width {width}, bucket cap {cap} B ({buckets} bucket{'s' if buckets > 1 else ''}), "
            f"{steps} steps, {dtype}"
        )
        out.append({**model, "batch": batch, "steps": steps, "cap": cap, "name": name})
    return out


def _model(case: _Model) -> nn.Module:
    torch.manual_seed(case["seed"])
    w = case["width"]
    layers: list[nn.Module] = [nn.Linear(5, w), nn.Tanh(), nn.Linear(w, 3)]
    if case["kind"].startswith("deep"):
        layers[2:2] = [nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w, bias=False), nn.Tanh()]
    model = nn.Sequential(*layers).to(getattr(torch, case["dtype"]))
    if case["kind"].endswith("frozen first layer"):
        for p in model[0].parameters():
            p.requires_grad_(False)
    return model


def _ready_order(case: _Model) -> list[int]:
    """Indices (in model.parameters()) of the parameters that get a gradient, in the order backward gives them."""
    model = _model(case)
    order: list[int] = []
    for index, p in enumerate(model.parameters()):
        if p.requires_grad:
            # torch leaves register_post_accumulate_grad_hook unannotated: typed here as documented.
            register = cast("Callable[[Callable[[torch.Tensor], None]], object]", p.register_post_accumulate_grad_hook)

            def note(_p: torch.Tensor, index: int = index) -> None:
                order.append(index)

            register(note)
    dtype = getattr(torch, case["dtype"])
    backward(model(torch.zeros(1, 5, dtype=dtype)).sum())
    return order


def _sizes(case: _Model) -> list[int]:
    """Bytes of each gradient, in the order backward produces them."""
    params = list(_model(case).parameters())
    return [params[i].numel() * params[i].element_size() for i in _ready_order(case)]


def _expected(sizes: list[int], cap: int) -> int:
    """Buckets when each is closed once it holds at least ``cap`` bytes (DDP's rule); the rest is one more."""
    count, held = 0, 0
    for size in sizes:
        held += size
        if held >= cap:
            count, held = count + 1, 0
    return count + (1 if held else 0)


def _expected_no_overflow(sizes: list[int], cap: int) -> int:
    """Buckets when a gradient that would take a bucket past ``cap`` starts a new one instead."""
    count, held = 0, 0
    for size in sizes:
        if held and held + size > cap:
            count, held = count + 1, 0
        held += size
    return count + (1 if held else 0)


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    dtype = getattr(torch, case["dtype"])
    world = dist.get_world_size()
    model = _model(case)
    reference = nn.parallel.DistributedDataParallel(_model(case))
    sizes = _sizes(case)
    expected = _expected(sizes, case["cap"])
    bounds = sorted((expected, _expected_no_overflow(sizes, case["cap"])))
    grad_elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
    watch = Watch(model, case["cap"])  # its hooks first: see backward_watch.py
    wrapped = learner["HookDDP"](model, case["cap"])
    gen = torch.Generator().manual_seed(case["seed"] + 1 + dist.get_rank())
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    overlap = _Overlap(sizes, case["cap"], watch.element_size)

    problem: str | None = None
    measured: dict[str, float] = {}
    for step in range(case["steps"]):
        x = torch.randn(case["batch"], 5, generator=gen, dtype=dtype)
        y = torch.randn(case["batch"], 3, generator=gen, dtype=dtype)
        backward(nn.functional.mse_loss(reference(x), y))

        loss = nn.functional.mse_loss(model(x), y)
        with watch.step() as now:
            watch.backward(loss)
            local = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
            wrapped.finish()
        during = [launch for launch in now.launches if launch.in_backward]
        measured = {
            "launched_in_backward": len(during),
            "launched_in_finish": len(now.launches) - len(during),
            "buckets": len(now.launches),
            "expected_buckets": expected,
            "overlap_launched": round(overlap.launched(during), 3),
            "overlap_theory": round(overlap.theory, 3),
        }
        if problem is None:
            problem = _gradients(model, reference, local, world, tol, step)
        if problem is None:
            problem = _schedule(now.launches, during, now.waits, grad_elements, step)
        if problem is None:
            problem = _buckets(now.launches, during, now.late, overlap, expected, bounds, case["cap"], step)

        # Both copies take DDP's step, so the next step compares from equal weights whatever happened here.
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.module.parameters()):
                if q.grad is not None:
                    q -= 0.1 * q.grad
                p.copy_(q)
        in_place = step % 2 == 1
        model.zero_grad(set_to_none=not in_place)
        reference.zero_grad(set_to_none=not in_place)

    return failed(problem, **measured) if problem else passed(**measured)


def _gradients(
    model: nn.Module,
    reference: nn.parallel.DistributedDataParallel,
    local: dict[str, torch.Tensor | None],
    world: int,
    tol: dict[str, float],
    step: int,
) -> str | None:
    at = f"after step {step + 1}"
    for (name, p), (_, q) in zip(model.named_parameters(), reference.module.named_parameters()):
        if q.grad is None:
            if p.grad is not None:
                return f"`{name}` does not require a gradient, yet has one {at}"
            continue
        if p.grad is None:
            return f"`{name}`'s gradient is gone (None) {at}: finish() must leave every gradient in p.grad"
        wrong = first_difference(p.grad, q.grad, **tol)
        if wrong is None:
            continue
        if first_difference(p.grad, q.grad * world, **tol) is None:
            return (
                f"`{name}`'s gradient {at} is {world} times DDP's, the sum over the ranks, not the mean: "
                "divide by the world size"
            )
        own = local[name]
        if own is not None and first_difference(p.grad, own, **tol) is None:
            return (
                f"`{name}`'s gradient {at} is this rank's own, unchanged: it was not reduced across the ranks "
                "(is its hook registered, and is every bucket's result copied back to p.grad in finish()?)"
            )
        return f"`{name}`'s gradient {at} differs from DDP's at {wrong}"
    return None


def _schedule(
    launches: list[Launch], during: list[Launch], waits: list[str], grad_elements: int, step: int
) -> str | None:
    """How the all-reduces were made: each gradient once, asynchronously, never waited on inside backward."""
    at = f"in step {step + 1}"
    reduced = sum(launch.numel for launch in launches)
    if reduced > grad_elements:
        return (
            f"{reduced} elements all-reduced {at} for {grad_elements} gradient elements: gradients are reduced "
            "more than once a step. Are the hooks registered again each step (register them once, in __init__), "
            "or is a bucket not emptied after it is sent?"
        )
    if not launches:
        return f"no dist.all_reduce call {at}: launch each bucket's all-reduce with dist.all_reduce(..., async_op=True)"
    if any(not launch.is_async for launch in during):
        return (
            f"an all-reduce in backward was synchronous (async_op=False) {at}: it blocks backward until it is "
            "done. Launch it with async_op=True, keep the work handle and wait in finish()"
        )
    if waits:
        return (
            f"a bucket's all-reduce was waited on before backward returned {at} ({waits[0]} in a hook): that "
            "blocks backward until the all-reduce is done, so the two run one after the other, not at once. "
            "Keep the work handles and wait for them in finish()"
        )
    return None


def _buckets(
    launches: list[Launch],
    during: list[Launch],
    late: Late | None,
    overlap: _Overlap,
    expected: int,
    bounds: list[int],
    cap: int,
    step: int,
) -> str | None:
    """When the all-reduces were launched, against DDP's buckets: each as soon as it is full."""
    at = f"in step {step + 1}"
    against = (
        f"{overlap.launched(during):.0%} of the gradient bytes were launched while backward still had gradients "
        f"to compute, where DDP's buckets launch {overlap.theory:.0%}"
    )
    if expected > 1 and not during:
        launched = "the one all-reduce was" if len(launches) == 1 else f"all {len(launches)} all-reduces were"
        return (
            f"{launched} launched in finish(), after backward {at}: no overlap: "
            f"launch each bucket's all-reduce from the hook, as soon as the bucket is full ({against})"
        )
    if late is not None:
        return (
            f"a bucket was full after gradient {late.after} of {overlap.gradients} became ready {at} ({late.pending} "
            f"bytes waiting, cap {cap}), yet backward went on to the next gradient before its all-reduce was "
            f"launched: {against}. Launch a bucket's all-reduce from the hook that fills it"
        )
    if expected > 1 and len(during) < expected - 1:
        return (
            f"only {len(during)} of {len(launches)} all-reduces were launched during backward {at}: every full "
            "bucket's all-reduce must be launched from the hook (only the last, partly filled one may wait for "
            "finish())"
        )
    if (
        len(launches) == overlap.gradients
        and expected < overlap.gradients
        and not bounds[0] <= len(launches) <= bounds[1]
    ):
        return (
            f"one all-reduce per parameter ({len(launches)}) {at}, though a cap of {cap} bytes groups them into "
            f"{expected} buckets: gather gradients into a bucket until it holds bucket_cap_bytes"
        )
    if len(launches) == 1 and expected > 1:
        return (
            f"everything in one all-reduce {at}, though a cap of {cap} bytes makes {expected} buckets: "
            "close a bucket and launch it once it holds bucket_cap_bytes"
        )
    return None


class _Overlap:
    """The share of the gradient bytes whose all-reduce is launched while backward has gradients left to compute.

    DDP's buckets (``theory``): all but the bucket the last gradient closes or leaves for finish().
    """

    def __init__(self, sizes: list[int], cap: int, element_size: int) -> None:
        self.gradients, self.total, self.element_size = len(sizes), sum(sizes), element_size
        early, held = 0, 0
        for index, size in enumerate(sizes):
            held += size
            if held >= cap and index < len(sizes) - 1:
                early, held = early + held, 0
        self.theory = early / self.total

    def launched(self, during: list[Launch]) -> float:
        early = sum(launch.numel for launch in during if launch.is_async and launch.ready < self.gradients)
        return min(early * self.element_size / self.total, 1.0)
