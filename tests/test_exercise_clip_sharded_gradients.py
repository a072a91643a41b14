"""clip-sharded-gradients: the mistakes learners make clipping FSDP2's sharded gradients, each named (graded
by test_exercises_graded.py)."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

harness = Harness("clip-sharded-gradients")
lab = learners_lab()

# Each rank's own shards' norm: the ranks disagree, and each scales by its own.
LOCAL_NORM = """
def clip_grad_norm(model, max_norm):
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads)).item()
    if max_norm / (norm + 1e-6) < 1:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm
"""

# Norms all-reduced as if they added.
NORMS_ADDED = """
def clip_grad_norm(model, max_norm):
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    total = torch.stack([g.norm() for g in grads]).sum()
    dist.all_reduce(total)
    norm = total.item()
    if max_norm / (norm + 1e-6) < 1:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm
"""

NO_SQUARE_ROOT = """
def clip_grad_norm(model, max_norm):
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    squares = sum(g.double().pow(2).sum() for g in grads)
    dist.all_reduce(squares)
    norm = squares.item()
    if max_norm / (norm + 1e-6) < 1:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm
"""

SCALES_UP_TOO = """
def clip_grad_norm(model, max_norm):
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    squares = sum(g.double().pow(2).sum() for g in grads)
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    for g in grads:
        g.mul_(max_norm / (norm + 1e-6))
    return norm
"""

SCALES_A_COPY = """
def clip_grad_norm(model, max_norm):
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    squares = sum(g.double().pow(2).sum() for g in grads)
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    if max_norm / (norm + 1e-6) < 1:
        for g in grads:
            g = g * (max_norm / (norm + 1e-6))
    return norm
"""

FROZEN_PARAMETERS = """
def clip_grad_norm(model, max_norm):
    grads = [p.grad.to_local() for p in model.parameters()]
    squares = sum(g.double().pow(2).sum() for g in grads)
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    if max_norm / (norm + 1e-6) < 1:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm
"""

MISTAKES = {
    "local-norm": (LOCAL_NORM, "the ranks returned different norms"),
    "norms-added": (NORMS_ADDED, "norms do not add, their squares do"),
    "no-square-root": (NO_SQUARE_ROOT, "the sum of the squares, without its square root"),
    "scales-up-too": (SCALES_UP_TOO, "clipping only ever scales down"),
    "scales-a-copy": (SCALES_A_COPY, "scale the shards in place"),
    "frozen-parameters": (FROZEN_PARAMETERS, "NoneType"),
}


def reference_measures(result):
    # the cases under the bound are left alone; the others scaled by their fraction (0.3, 0.01, 0.5)
    scales = sorted(round(case.measured["scale"], 3) for case in result.cases)
    assert scales == sorted([0.3, 1.0, 0.01, 0.5] * len({case.world_size for case in result.cases}))
