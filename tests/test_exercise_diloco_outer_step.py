"""diloco-outer-step: the mistakes learners make in DiLoCo's outer step, each named (graded by
test_exercises_graded.py)."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

harness = Harness("diloco-outer-step")
lab = learners_lab()

LOCAL_SGD = """
def outer_step(model, anchor, outer_opt):
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            dist.all_reduce(p)
            p /= dist.get_world_size()
            a.copy_(p)
"""

REVERSED = """
def outer_step(model, anchor, outer_opt):
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            mean = p.detach().clone()
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
            a.grad = mean - a
        outer_opt.step()
        for p, a in zip(model.parameters(), anchor):
            p.copy_(a)
"""

MODEL_NOT_RESET = """
def outer_step(model, anchor, outer_opt):
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            mean = p.detach().clone()
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
            a.grad = a - mean
        outer_opt.step()
"""

SUM_NOT_MEAN = """
def outer_step(model, anchor, outer_opt):
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            total = p.detach().clone()
            dist.all_reduce(total)
            a.grad = a - total
        outer_opt.step()
        for p, a in zip(model.parameters(), anchor):
            p.copy_(a)
"""

NO_OUTER_STEP = """
def outer_step(model, anchor, outer_opt):
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            mean = p.detach().clone()
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
            a.grad = a - mean
        for p, a in zip(model.parameters(), anchor):
            p.copy_(a)
"""

MISTAKES = {
    "local-sgd": (LOCAL_SGD, "that is local SGD"),
    "reversed": (REVERSED, "the outer gradient is anchor - average, not average - anchor"),
    "model-not-reset": (MODEL_NOT_RESET, "copy it into the model's parameters"),
    "sum-not-mean": (SUM_NOT_MEAN, "check the average"),
    "no-outer-step": (NO_OUTER_STEP, "did not change"),
}
