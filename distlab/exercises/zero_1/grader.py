"""Grader of ``zero-1``: Adam with its state sharded over the ranks (ZeRO stage 1), from reduce-scatter and all-gather.

Each case builds the same model on every rank (one seed) and a reference copy. Every step, each rank
computes the gradient of its own batch on both copies. The reference copy is stepped by
``torch.optim.Adam`` on the mean gradient (one all-reduce of the grader's own, made on every rank
whatever the learner did); the learner's copy by ``Zero1Adam.step()``, which must average the
gradients itself. After every step the learner's parameters must equal the reference's within
float32 rounding. Parameter counts are never divisible by the world size.

Adam hardly changes when every gradient is scaled (m / sqrt(v) does not see the scale, only eps does),
so summing instead of averaging can pass with gradients of the usual size: some cases scale the loss
so that gradients are about 1e-7, where Adam's eps (1e-8) makes the update depend on the scale.

After the last step the bytes of the tensors the learner's optimizer holds (walking its attributes,
lists, dicts and nested objects; the model's own parameters and gradients are not counted) are
measured against theory: 2 fp32 moments of numel / N parameters (``distlab.theory.memory_breakdown``
with ZeRO stage 1).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import TypedDict

import torch
import torch.distributed as dist
from torch import nn

from ...rank.exercise import Learner, Tolerance, backward, failed, first_difference, grad_of, passed
from ...theory import memory_breakdown

_BETAS = (0.9, 0.999)
_EPS = 1e-8
_TOL: Tolerance = {"rtol": 1e-5, "atol": 1e-6}

# (kind, loss scale): 1e-7 makes gradients small enough for eps to matter (see the module's text).
_KINDS = (("mlp", 1e-7), ("deep", 1.0), ("deep", 1e-7))


class Case(TypedDict):
    name: str
    kind: str  # "mlp" or "deep"
    scale: float  # of the loss
    batch: int
    steps: int
    lr: float
    inputs: int
    width: int
    seed: int


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
    for kind, scale in _KINDS:
        batch, steps = rng.randrange(2, 9), rng.randrange(3, 6)
        lr = rng.choice((1e-3, 3e-3, 1e-2))
        while True:  # a parameter count the world size does not divide
            inputs, width = rng.randrange(3, 9), rng.randrange(3, 20)
            numel = sum(p.numel() for p in _layers(kind, inputs, width).parameters())
            if numel % world_size:
                break
        small = ", gradients ~1e-7" if scale != 1.0 else ""
        out.append(
            {
                "kind": kind,
                "scale": scale,
                "batch": batch,
                "steps": steps,
                "lr": lr,
                "inputs": inputs,
                "width": width,
                "seed": rng.randrange(2**31),
                "name": f"{kind}, {numel} parameters, {steps} steps, lr {lr:g}{small}",
            }
        )
    return out


def _layers(kind: str, inputs: int, w: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(inputs, w), nn.Tanh(), nn.Linear(w, 3)]
    if kind == "deep":
        layers[2:2] = [nn.Linear(w, w + 1), nn.ReLU(), nn.Linear(w + 1, w, bias=False), nn.Tanh()]
    return nn.Sequential(*layers)


def _model(case: Case) -> nn.Module:
    torch.manual_seed(case["seed"])
    return _layers(case["kind"], case["inputs"], case["width"])


def _flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _first_step_variants(before: torch.Tensor, mean: torch.Tensor, lr: float, world: int) -> dict[str, torch.Tensor]:
    """Parameters after a first Adam step made with a likely mistake (from zero state), by mistake."""
    b1, b2 = _BETAS

    def step(g: torch.Tensor, t_m: float, t_v: float) -> torch.Tensor:
        m, v = (1 - b1) * g, (1 - b2) * g * g
        m_hat = m / (1 - b1**t_m) if t_m else m
        v_hat = v / (1 - b2**t_v) if t_v else v
        return before - lr * m_hat / (v_hat.sqrt() + _EPS)

    return {
        f"the gradients were summed, not averaged: the update is Adam's on {world} times the mean gradient "
        "(divide the reduce-scattered gradient by the world size)": step(mean * world, 1, 1),
        "no bias correction: divide exp_avg by 1 - beta1**t and exp_avg_sq by 1 - beta2**t": step(mean, 0, 0),
        "the bias correction used step count 2 at the first step: count the step (t = 1 first) once per "
        "step() call, before using it": step(mean, 2, 2),
    }


def _held_bytes(optimizer: object, exclude: set[int]) -> int:
    """Bytes of the distinct tensor storages reachable from ``optimizer``, but those in ``exclude``."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    todo: list[object] = [optimizer]
    while todo:
        thing = todo.pop()
        if id(thing) in seen_objects or isinstance(thing, (str, bytes, int, float, bool, type(None))):
            continue
        seen_objects.add(id(thing))
        if isinstance(thing, torch.Tensor):
            storage = thing.untyped_storage()
            if storage.data_ptr() not in exclude and storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(thing, dict):
            todo.extend(thing.keys())
            todo.extend(thing.values())
        elif isinstance(thing, (list, tuple, set, frozenset)):
            todo.extend(thing)
        elif isinstance(thing, nn.Module):
            continue  # a model: its parameters are the model's, not optimizer state
        elif hasattr(thing, "__dict__") and not isinstance(thing, type) and not callable(thing):
            todo.extend(vars(thing).values())
        elif hasattr(thing, "__slots__"):
            todo.extend(getattr(thing, slot) for slot in thing.__slots__ if hasattr(thing, slot))
    return sum(storages.values())


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    world = dist.get_world_size()
    model, reference = _model(case), _model(case)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    optimizer = learner["Zero1Adam"](model.parameters(), case["lr"])
    adam = torch.optim.Adam(reference.parameters(), lr=case["lr"], betas=_BETAS, eps=_EPS)
    gen = torch.Generator().manual_seed(case["seed"] + 1 + dist.get_rank())

    problem: str | None = None
    for step in range(case["steps"]):
        x, y = torch.randn(case["batch"], case["inputs"], generator=gen), torch.randn(case["batch"], 3, generator=gen)
        model.zero_grad(set_to_none=True)
        adam.zero_grad(set_to_none=True)
        backward(case["scale"] * nn.functional.mse_loss(reference(x), y))
        backward(case["scale"] * nn.functional.mse_loss(model(x), y))
        mean = _flat(grad_of(p) for p in reference.parameters())
        dist.all_reduce(mean)  # the grader's own: on every rank, every step
        mean /= world
        offset = 0
        for p in reference.parameters():
            grad_of(p).copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        before = _flat(params)
        adam.step()
        optimizer.step()
        if problem is None:
            problem = _compare(_flat(params), _flat(reference.parameters()), before, mean, case["lr"], world, step)

    exclude = {p.untyped_storage().data_ptr() for p in params}
    exclude |= {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    held = _held_bytes(optimizer, exclude)
    theory = memory_breakdown(numel, devices=world, zero_stage=1, precision="fp32", optimizer="adam")
    full = 2 * numel * 4
    measured = {
        "optimizer_bytes": held,
        "theory_bytes": round(theory.optimizer_states_bytes, 1),
        "unsharded_bytes": full,
        "ratio_to_theory": round(held / theory.optimizer_states_bytes, 3),
    }
    if problem is None and held >= 0.9 * full:
        problem = (
            f"the optimizer holds {held} bytes of tensors after step(), as much as full Adam state for all "
            f"{numel} parameters ({full} bytes); sharded over {world} ranks it should be about {full / world:.0f}: "
            f"not sharded. Keep exp_avg and exp_avg_sq for this rank's 1/{world} of the flattened parameters "
            "only, and free temporary full-size buffers when step() returns"
        )
    return failed(problem, **measured) if problem else passed(**measured)


def _compare(
    got: torch.Tensor,
    expected: torch.Tensor,
    before: torch.Tensor,
    mean: torch.Tensor,
    lr: float,
    world: int,
    step: int,
) -> str | None:
    wrong = first_difference(got, expected, **_TOL)
    if wrong is None:
        return None
    at = f"after step {step + 1}"
    if not torch.isfinite(got).all():
        return (
            f"parameters are inf or nan {at}: is the bias correction dividing by zero (1 - beta**0)? "
            "The step count must be 1 at the first step"
        )
    bad = ~torch.isclose(got, expected, **_TOL)
    if torch.equal(got[bad], before[bad]):
        stale = int(bad.sum())
        return (
            f"{stale} of {got.numel()} parameters were not updated {at} (the first wrong: flat index "
            f"{int(bad.nonzero()[0])}): they belong to other ranks' shards. all-gather the updated shards "
            "into every rank's parameters"
        )
    if step == 0:
        for mistake, variant in _first_step_variants(before, mean, lr, world).items():
            if first_difference(got, variant, **_TOL) is None:
                return f"the parameters {at} are not Adam's: {mistake}"
    else:
        return (
            f"the parameters are Adam's after step 1 but not {at}, at flat {wrong}: check the bias correction "
            "(1 - beta**t, t the number of steps taken, this one included) and that exp_avg and exp_avg_sq "
            "are kept from one step to the next"
        )
    return f"the parameters {at} differ from Adam's on the mean gradient at flat {wrong}"
