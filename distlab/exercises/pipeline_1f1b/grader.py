"""Grader of ``pipeline-1f1b``: a two-stage pipeline run by the learner in 1F1B order.

Both ranks build the same model (one seed) and each gives the learner its own half, rank 0 the first
stage and the micro-batches, rank 1 the second stage and the targets. The reference is the whole model
in this process, the loss the mean of the micro-batches' losses: each stage's gradients must equal the
matching parameters' gradients of it, within float rounding (the micro-batches' gradients are added in
another order).

The learner's call is recorded (``schedule.py``): each stage's forwards, backwards and messages, in
order. Graded from that order, not from a clock: the forwards and backwards must come in torch's
``Schedule1F1B`` order (``distlab.theory.pipeline_schedule``), and the step laid out from both
stages' orders (a forward one unit, a backward two, messages free) must idle no more than theory's
``(p-1)/(m+p-1)``, which 1F1B's order reaches exactly: a stage that sends a tensor later than it
could keeps the other waiting (at worst the stages take turns), and fails. The timed case also shows
each stage's measured idle time against the theory, never failed on: messages are not free on gloo
over loopback, and when both stages share one core the clock cannot show a bubble at all.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping
from typing import TypedDict

import torch
import torch.distributed as dist
from torch import nn

from ...rank.exercise import Learner, backward, failed, first_difference, grad_of, passed
from ...theory.pipeline import bubble_fraction, pipeline_schedule
from .schedule import Action, Layout, Recorder, laid_out, late_send

_STAGES = 2


class Case(TypedDict):
    name: str
    micro_batches: int
    timed: bool
    batch: int
    d_in: int
    width: int
    d_out: int
    seed: int


class _Stage(TypedDict):
    """What a stage recorded of the learner's step, sent to the other."""

    actions: list[Action]
    in_flight: int  # the most micro-batches it had in flight
    idle: float  # its share of the step's time (timed)
    cores: list[int]  # those it may run on


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
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


def _halves(case: Case) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(case["seed"])
    w = case["width"]
    first = nn.Sequential(nn.Linear(case["d_in"], w), nn.Tanh(), nn.Linear(w, w), nn.Tanh())
    second = nn.Sequential(nn.Linear(w, w), nn.Tanh(), nn.Linear(w, case["d_out"]))
    return first, second


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
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
    recorder = Recorder(stage, r)
    activation_shape = (case["batch"], case["width"])

    def step() -> tuple[object, float]:
        dist.barrier()  # both stages start the clock together
        start = time.perf_counter()
        with recorder.watching():
            returned = learner["one_f_one_b"](
                stage, inputs if r == 0 else None, targets if r == 1 else None, loss_fn, activation_shape
            )
        return returned, time.perf_counter() - start

    if timed:  # a step first, untimed: the first one pays for allocations and lazy set-up
        step()
        stage.zero_grad(set_to_none=True)
        recorder.clear()
    returned, total_s = step()
    # Every rank gathers what the other recorded, whatever its own result: none may leave the other waiting.
    mine: _Stage = {
        "actions": recorder.actions,
        "in_flight": _most_in_flight(recorder.order),
        "idle": 1.0 - min(recorder.busy_s / total_s, 1.0) if total_s > 0 else 0.0,
        "cores": sorted(os.sched_getaffinity(0)),
    }
    both: list[_Stage] = [mine] * _STAGES  # each replaced by that stage's
    dist.all_gather_object(both, mine)
    layout = laid_out([stage_of["actions"] for stage_of in both])
    theory = bubble_fraction(_STAGES, m, "1f1b")
    measured: dict[str, float] = {f"in_flight_stage_{s}": both[s]["in_flight"] for s in range(_STAGES)}
    measured.update(bubble_theory=round(theory, 4))
    if layout is not None:
        measured.update(bubble_of_order=round(layout.whole, 4))
    if timed:  # with little work per micro-batch the messages, not the schedule, make the idle time
        measured.update({f"bubble_stage_{s}": round(both[s]["idle"], 4) for s in range(_STAGES)})
        measured.update(step_s=round(total_s, 4))

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
    bubble = _bubble_mistake(layout, theory, [stage_of["actions"] for stage_of in both])
    idles = bubble[1] if bubble is not None and bubble[0] in (None, r) else None  # said by the stage to blame
    if recorder.order != expected:
        also = f"; and {idles}" if idles else ""
        return failed(_order_mistake(recorder.order, expected, r, m) + also, **measured)
    if idles:
        return failed(idles, **measured)
    if timed:
        return passed(_timed_note(both, r, m, theory), **measured)
    return passed(**measured)


# ---------------------------------------------------------------------------- mistakes in words


def _bubble_mistake(layout: Layout | None, theory: float, actions: list[list[Action]]) -> tuple[int | None, str] | None:
    """(the stage to blame, or None for both; what is wrong) when the order idles more than 1F1B's, else None."""
    if layout is None or layout.whole <= theory + 1e-9:
        return None
    late = late_send(actions)
    stage, why = late if late is not None else (None, "the stages wait on each other longer than 1F1B makes them")
    return stage, (
        f"{why}: laid out from the order of the forwards, backwards and messages (a forward one unit of time, "
        f"a backward two, messages free), the pipeline idles {layout.whole:.0%} of the step where 1F1B's theory "
        f"is {theory:.0%}, (p-1)/(m+p-1). Send each tensor as soon as it is made (dist.isend goes on while it "
        "travels), and wait for a message only where its tensor is needed"
    )


def _timed_note(both: list[_Stage], r: int, m: int, theory: float) -> str:
    idle = f"idle {both[r]['idle']:.0%} of the step (timed) against theory's {theory:.0%}"
    if len(set().union(*(stage_of["cores"] for stage_of in both))) < _STAGES:
        # One core runs one stage at a time: what the clock shows is the sharing, not a bubble.
        return f"{idle}: the two stages share one core here, so the time measured cannot show the bubble"
    # Theory's bubble counts messages as free; on gloo over loopback each send and receive costs
    # about a millisecond of two shared cores, as much as a micro-batch's compute here.
    return (
        f"{idle}: the theory counts messages as free, and here each of the {2 * m} messages per stage costs "
        "about as much as a micro-batch's compute"
    )


def _loss_mistake(returned: object, mean_loss: float, losses: list[float]) -> str | None:
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
