"""Grader of ``parameter-server``: one synchronous step of a parameter server built from send / recv.

Rank 0 is the server, ranks 1 .. N-1 the workers. Each case runs a few steps; before each, every rank's
``params`` are set to the server's current values (as a synchronous server leaves them) and every
worker gets gradients of its own (rank 0 gets zeros: it computes none). The reference step is made
with collectives: ``all_gather`` of every gradient, then the SGD step with the mean of the workers'
gradients, computed locally. The grader's collectives come before the learner's call in each step, on
every rank, and the learner is called every step whatever it did before, so no rank is left waiting in
a grader's collective or for a learner's send; each rank then compares its own params with the
reference and names the first step that went wrong.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from typing import TypedDict

import torch
import torch.distributed as dist

from ...rank.exercise import Learner, failed, first_difference, passed
from ...theory import parameter_server_received_bytes

_STEPS = 3


class Case(TypedDict):
    name: str
    shapes: list[list[int]]  # the params' shapes
    dtype: str  # a torch dtype's name: "float32"
    lr: float
    seed: int


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
    for dtype in ("float32", "float64", "float32"):
        shapes = []
        for _ in range(rng.randrange(1, 5)):
            dims = rng.randrange(0, 4)  # 0: a scalar parameter
            shapes.append([rng.randrange(1, 8) for _ in range(dims)])
        lr = round(rng.uniform(0.01, 0.5), 3)
        out.append(
            {
                "name": f"{len(shapes)} tensor{'s' if len(shapes) > 1 else ''} "
                f"{' '.join(_shape(s) for s in shapes)}, {dtype}, lr {lr}",
                "shapes": shapes,
                "dtype": dtype,
                "lr": lr,
                "seed": rng.randrange(2**31),
            }
        )
    return out


def _shape(shape: list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    step_fn = learner["parameter_server_step"]
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, lr = getattr(torch, case["dtype"]), case["lr"]
    gen = torch.Generator().manual_seed(case["seed"])
    server = [torch.randn(s, generator=gen, dtype=dtype) for s in case["shapes"]]  # the same on every rank
    problem: str | None = None
    seconds = 0.0
    for step in range(_STEPS):
        mine = torch.Generator().manual_seed(case["seed"] + 1000 * (step + 1) + rank)
        grads = [
            torch.zeros(s, dtype=dtype) if rank == 0 else torch.randn(s, generator=mine, dtype=dtype)
            for s in case["shapes"]
        ]
        # The reference, with collectives: every rank's gradients, then the workers' mean, locally.
        gathered = []
        for g in grads:
            each = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(each, g)
            gathered.append(each)
        worker_sum = [sum(each[1:], torch.zeros_like(each[0])) for each in gathered]
        new = [p - lr * s / (world - 1) for p, s in zip(server, worker_sum)]

        params = [p.clone() for p in server]
        kept = list(params)  # the very tensors passed: the step must change these
        started = time.perf_counter()
        step_fn(params, [g.clone() for g in grads], lr)
        seconds += time.perf_counter() - started
        if problem is None:
            problem = _problem(rank, world, step, kept, params, server, new, worker_sum, grads, lr, dtype)
        server = new

    size = sum(p.numel() * p.element_size() for p in server)
    measured = {
        "step_s": seconds / _STEPS,
        "server_received_bytes": parameter_server_received_bytes(size, world - 1),
    }
    return failed(problem, **measured) if problem is not None else passed(**measured)


def _problem(
    rank: int,
    world: int,
    step: int,
    kept: list[torch.Tensor],
    params: Sequence[object],  # the list the learner was given, whatever it put in it
    old: list[torch.Tensor],
    new: list[torch.Tensor],
    worker_sum: list[torch.Tensor],
    grads: list[torch.Tensor],
    lr: float,
    dtype: torch.dtype,
) -> str | None:
    """What is wrong with this rank's params after ``step``, and the likely mistake; None if they are right."""
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    who = "the server (rank 0)" if rank == 0 else f"worker {rank}"
    where = f"after step {step + 1}, on {who},"

    def like(got: torch.Tensor, expected: torch.Tensor) -> bool:
        return first_difference(got, expected, **tol) is None

    for i, (p, q) in enumerate(zip(kept, new)):
        if like(p, q):
            continue
        passed_now = params[i] if i < len(params) else None
        if passed_now is not p and isinstance(passed_now, torch.Tensor) and like(passed_now, q):
            return (
                f"{where} params[{i}] was replaced by a new tensor, the one passed is unchanged: update the "
                "tensors in place (p.copy_(...), or recv straight into p): a model's parameters are those tensors"
            )
        workers = world - 1
        mistakes = [
            (
                old[i],
                (
                    "params[{i}] are unchanged by the step: rank 0 must send the new params back to every worker, "
                    "and each worker copy them into its params in place"
                )
                if rank
                else "params[{i}] are unchanged by the step: the server must apply the SGD step to its own params, "
                "in place",
            ),
            (
                old[i] - lr * worker_sum[i] / world,
                (
                    f"params[{{i}}] took a step {workers}/{world} of the right one: the mean was taken over all "
                    f"{world} ranks, counting the server's own zero gradient; average over the {workers} workers only"
                ),
            ),
            (
                old[i] - lr * worker_sum[i],
                (
                    f"params[{{i}}] took {workers} times the right step: the workers' gradients were summed, not "
                    f"averaged; divide by the {workers} workers"
                ),
            ),
            (
                old[i] - 2 * lr * worker_sum[i] / workers,
                "params[{i}] took the step twice: apply the SGD step once, on the server only",
            ),
        ]
        if rank:
            mistakes += [
                (
                    new[i] - lr * grads[i],
                    (
                        "params[{i}] are the server's new params minus this worker's own gradient step: the worker "
                        "stepped too (a double step); only the server updates, workers just receive its params"
                    ),
                ),
                (
                    old[i] - lr * grads[i],
                    (
                        "params[{i}] took a step with this worker's own gradient, not the server's: workers must not "
                        "update; they receive the server's new params"
                    ),
                ),
            ]
        for expected, mistake in mistakes:
            if like(p, expected.to(dtype)):
                return f"{where} {mistake.format(i=i)}"
        return f"{where} params[{i}] differ from the reference SGD step at {first_difference(p, q, **tol)}"
    return None
