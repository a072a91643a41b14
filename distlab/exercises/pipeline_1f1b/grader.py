"""Grader of ``pipeline-1f1b``: a two-stage pipeline run by the learner in 1F1B order.

Both ranks build the same model (one seed) and each gives the learner its own half, rank 0 the first
stage and the micro-batches, rank 1 the second stage and the targets. The reference is the whole model
in this process, the loss the mean of the micro-batches' losses: each stage's gradients must equal the
matching parameters' gradients of it, within float rounding (the micro-batches' gradients are added in
another order). The stage's forward and the autograd backward calls are wrapped during the learner's
call: the forwards and backwards must come in torch's ``Schedule1F1B`` order
(``distlab.theory.pipeline_schedule``), and their time against the call's is the measured bubble,
reported beside theory's ``(p-1)/(m+p-1)`` and never failed on.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...rank.exercise import Learner, backward, failed, first_difference, grad_of, passed
from ...theory.pipeline import bubble_fraction, pipeline_schedule

_STAGES = 2
_NO_GRAD_INPUT = (
    "stage 1's input does not require a gradient, so stage 0 would get none: set requires_grad on the received "
    "activation and send its .grad back (x.requires_grad_() before stage 1's forward, then x.grad to stage 0 after "
    "the backward)"
)


def cases(world_size: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed * 1000 + world_size)
    out = []
    for kind, m in (("small", 2), ("small", rng.randrange(3, 7)), ("small", rng.randrange(5, 9)), ("timed", 8)):
        if kind == "timed":  # enough work per micro-batch that compute, not messages, fills the step
            d_in, width, d_out, batch = 64, 512, 16, 64
        else:
            d_in, width, d_out, batch = (
                rng.randrange(2, 9),
                rng.randrange(4, 33),
                rng.randrange(1, 6),
                rng.randrange(1, 7),
            )
        out.append(
            {
                "name": f"{m} micro-batches of {batch}, width {width}" + (", timed" if kind == "timed" else ""),
                "micro_batches": m,
                "timed": kind == "timed",
                "batch": batch,
                "d_in": d_in,
                "width": width,
                "d_out": d_out,
                "seed": rng.randrange(2**31),
            }
        )
    return out


def _halves(case: dict[str, Any]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(case["seed"])
    w = case["width"]
    first = nn.Sequential(nn.Linear(case["d_in"], w), nn.Tanh(), nn.Linear(w, w), nn.Tanh())
    second = nn.Sequential(nn.Linear(w, w), nn.Tanh(), nn.Linear(w, case["d_out"]))
    return first, second


def grade(case: dict[str, Any], learner: Learner) -> dict[str, Any]:
    if dist.get_world_size() != _STAGES:
        raise ValueError(f"pipeline-1f1b is graded with {_STAGES} ranks, not {dist.get_world_size()}")
    r, m = dist.get_rank(), case["micro_batches"]
    gen = torch.Generator().manual_seed(case["seed"] + 1)  # the same data on both ranks
    inputs = [torch.randn(case["batch"], case["d_in"], generator=gen) for _ in range(m)]
    targets = [torch.randn(case["batch"], case["d_out"], generator=gen) for _ in range(m)]
    loss_fn = nn.functional.mse_loss

    # The whole model in this process: each micro-batch's gradients, and the mean loss.
    whole = nn.Sequential(*_halves(case))
    mine_in_whole = list(whole[r].parameters())
    per_micro_batch, losses = [], []
    for x, y in zip(inputs, targets):
        whole.zero_grad(set_to_none=True)
        loss = loss_fn(whole(x), y)
        backward(loss)
        losses.append(loss.item())
        per_micro_batch.append([grad_of(p).clone() for p in mine_in_whole])
    reference = [sum(gs) / m for gs in zip(*per_micro_batch)]
    mean_loss = sum(losses) / m

    stage = _halves(case)[r]
    timed = case["timed"]
    order, spent = _record(stage, r)
    activation_shape = (case["batch"], case["width"])

    def step() -> tuple[Any, float]:
        dist.barrier()  # both stages start the clock together
        start = time.perf_counter()
        returned = learner["one_f_one_b"](
            stage, inputs if r == 0 else None, targets if r == 1 else None, loss_fn, activation_shape
        )
        return returned, time.perf_counter() - start

    try:
        if timed:  # a step first, untimed: the first one pays for allocations and lazy set-up
            step()
            stage.zero_grad(set_to_none=True)
            order.clear()
            spent.update(busy_s=0.0, forwards=0)
        returned, total_s = step()
    finally:
        _unrecord(stage)
    # Every rank gathers what the other measured, whatever its own result: none may leave the other waiting.
    idle = 1.0 - min(spent["busy_s"] / total_s, 1.0) if total_s > 0 else 0.0
    mine = torch.tensor([idle, _most_in_flight(order), total_s], dtype=torch.float64)
    both = [torch.zeros(3, dtype=torch.float64) for _ in range(_STAGES)]
    dist.all_gather(both, mine)
    measured: dict[str, Any] = {f"in_flight_stage_{s}": int(both[s][1]) for s in range(_STAGES)}
    if timed:  # with little work per micro-batch the messages, not the schedule, make the idle time
        measured.update({f"bubble_stage_{s}": round(both[s][0].item(), 4) for s in range(_STAGES)})
        measured.update(bubble_theory=round(bubble_fraction(_STAGES, m, "1f1b"), 4), step_s=round(total_s, 4))

    if r == 1:
        wrong = _loss_mistake(returned, mean_loss, losses)
        if wrong:
            return failed(wrong, **measured)
    names = [name for name, _ in stage.named_parameters()]
    for index, (name, p) in enumerate(stage.named_parameters()):
        if p.grad is None:
            return failed(_no_gradient(r, name), **measured)
        wrong = _gradient_mistake(p.grad, reference[index], [g[index] for g in per_micro_batch], m)
        if wrong:
            return failed(f"stage {r}'s `{names[index]}`: {wrong}", **measured)
    expected = pipeline_schedule(_STAGES, m, "1f1b")[r]
    if order != expected:
        return failed(_order_mistake(order, expected, r, m), **measured)
    if timed:
        # Theory's bubble counts messages as free; on gloo over loopback each send and receive costs
        # about a millisecond of two shared cores, as much as a micro-batch's compute here.
        return passed(
            f"idle {measured[f'bubble_stage_{r}']:.0%} of the step against theory's "
            f"{measured['bubble_theory']:.0%}: the theory counts messages as free, and here each of the "
            f"{2 * m} messages per stage costs about as much as a micro-batch's compute",
            **measured,
        )
    return passed(**measured)


# ---------------------------------------------------------------------------- watching the learner's call


def _record(stage: nn.Module, r: int) -> tuple[list[str], dict[str, float]]:
    """Wrap the stage's forward and autograd's backward calls: the order of F and B, and the time spent."""
    order: list[str] = []
    spent = {"busy_s": 0.0, "forwards": 0}
    module_forward = stage.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        index = int(spent["forwards"])
        spent["forwards"] += 1
        if r == 1 and torch.is_grad_enabled():
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if tensors and not any(t.requires_grad for t in tensors):
                raise RuntimeError(_NO_GRAD_INPUT)
        began = time.perf_counter()
        out = module_forward(*args, **kwargs)
        spent["busy_s"] += time.perf_counter() - began
        order.append(f"F{index}")
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # The gradient reaching this micro-batch's output: its backward through this stage begins.
            # torch leaves Tensor.register_hook unannotated.
            out.register_hook(lambda grad, index=index: order.append(f"B{index}"))
        return out

    stage.forward = forward
    depth = 0

    def timed(backward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal depth
            depth += 1  # Tensor.backward calls torch.autograd.backward: time the outer call only
            began = time.perf_counter()
            try:
                return backward(*args, **kwargs)
            finally:
                depth -= 1
                if depth == 0:
                    spent["busy_s"] += time.perf_counter() - began

        run.__wrapped__ = backward  # type: ignore[attr-defined]
        return run

    torch.Tensor.backward = timed(torch.Tensor.backward)  # type: ignore[method-assign]
    torch.autograd.backward = timed(torch.autograd.backward)
    return order, spent


def _unrecord(stage: nn.Module) -> None:
    del stage.forward
    torch.Tensor.backward = torch.Tensor.backward.__wrapped__  # type: ignore[attr-defined,method-assign]
    torch.autograd.backward = torch.autograd.backward.__wrapped__  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- mistakes in words


def _loss_mistake(returned: Any, mean_loss: float, losses: list[float]) -> str | None:
    if isinstance(returned, torch.Tensor) and returned.numel() == 1:
        returned = returned.item()
    if not isinstance(returned, (int, float)):
        return f"rank 1 returned {type(returned).__name__}, expected the mean loss over the micro-batches (a number)"
    if abs(returned - mean_loss) <= 1e-5 * max(1.0, abs(mean_loss)):
        return None
    m = len(losses)
    if m > 1 and abs(returned - m * mean_loss) <= 1e-5 * max(1.0, abs(m * mean_loss)):
        return f"rank 1 returned {returned:.6g}, the sum of the {m} micro-batches' losses: return their mean"
    return f"rank 1 returned {returned:.6g}, expected the mean loss over the micro-batches, {mean_loss:.6g}"


def _no_gradient(r: int, name: str) -> str:
    if r == 0:
        return (
            f"stage 0's `{name}` got no gradient: stage 1 must send back the gradient of each received activation "
            "(set requires_grad on the received activation and send its .grad back), and stage 0 call "
            "output.backward(that gradient) on the matching micro-batch's output"
        )
    return f"stage 1's `{name}` got no gradient: call backward on each micro-batch's loss"


def _gradient_mistake(got: torch.Tensor, want: torch.Tensor, each: list[torch.Tensor], m: int) -> str | None:
    tol = {"rtol": 1e-4, "atol": 1e-6}
    wrong = first_difference(got, want, **tol)
    if wrong is None:
        return None
    if m > 1 and first_difference(got, want * m, **tol) is None:
        return (
            f"the gradient is {m} times the unsplit model's: the loss is the mean over the micro-batches, so "
            f"divide each micro-batch's loss by their number ({m}) before its backward"
        )
    if m > 1 and (first_difference(got, each[-1] / m, **tol) is None or first_difference(got, each[-1], **tol) is None):
        return (
            "the gradient is the last micro-batch's alone: gradients must accumulate over the micro-batches "
            "(do not zero them, or replace .grad, between micro-batches)"
        )
    return f"the gradient differs from the unsplit model's at {wrong}"


def _most_in_flight(order: list[str]) -> int:
    """The most micro-batches forwarded and not yet backwarded at once."""
    in_flight = most = 0
    for action in order:
        in_flight += 1 if action.startswith("F") else -1
        most = max(most, in_flight)
    return most


def _order_mistake(order: list[str], expected: list[str], r: int, m: int) -> str:
    ran, want = " ".join(order), " ".join(expected)
    most = _most_in_flight(order)
    if m > _STAGES and most == m and all(a.startswith("F") for a in order[:m]):
        return (
            f"that is GPipe: all forwards before any backward keeps m = {m} micro-batches in flight on stage {r}; "
            f"1F1B holds at most {_STAGES - r} (stage {r} ran {ran}; 1F1B is {want})"
        )
    return f"stage {r} ran {ran or 'nothing'}, {most} micro-batches in flight at most; 1F1B's order is {want}"
