"""average-gradients: the mistakes learners make, each named (graded by test_exercises_graded.py); a deadlock
and a dead rank stopped and named, and the learner's names and lab left as they were."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

harness = Harness("average-gradients")
lab = learners_lab()


FORGOT_TO_DIVIDE = """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
"""

NEVER_COMMUNICATES = """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= world_size
"""

FROZEN_PARAMETERS = """
def average_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
"""

WEIGHTS_NOT_GRADIENTS = """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.data)
            p.data /= world_size
"""

NOT_IN_PLACE = """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad = p.grad / world_size
"""

ALL_REDUCES_A_COPY = """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            summed = p.grad.clone()
            dist.all_reduce(summed)
            p.grad = summed / world_size
"""

SWAPS_THE_MEMORY = """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.data = p.grad / world_size
"""

A_NEW_VIEW = """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad = p.grad.div_(world_size).view(p.grad.shape)
"""


MISTAKES = {
    "forgot-to-divide": (FORGOT_TO_DIVIDE, "divide by the world size"),
    "never-communicates": (NEVER_COMMUNICATES, "not reduced across ranks"),
    "frozen-parameters": (FROZEN_PARAMETERS, "NoneType"),
    "weights-not-gradients": (WEIGHTS_NOT_GRADIENTS, "unchanged"),
    "not-in-place": (NOT_IN_PLACE, "holds the mean, but in a new tensor assigned to `.grad` (`p.grad = ...`)"),
    "all-reduces-a-copy": (
        ALL_REDUCES_A_COPY, "holds the mean, but in a new tensor assigned to `.grad` (`p.grad = ...`)"
    ),
    "swaps-the-memory": (
        SWAPS_THE_MEMORY, "holds the mean, but in new memory put under the same tensor (`p.grad.data = ...`)"
    ),
    "a-new-view": (A_NEW_VIEW, "holds the mean, but in a new tensor object over the old memory"),
}


def test_a_deadlock_is_stopped_named_and_both_labs_work_afterwards(lab):
    harness.warm(lab)
    deadlock = """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.recv(p.grad, src=1 - rank % 2)
"""
    from distlab.exercises.grading import grading_lab

    before = {r.pid for r in grading_lab(lab, 2).table}
    result = harness.check(lab, deadlock, case_timeout_s=5)
    assert not result.passed
    # the ranks the stopped case left are not the next check's: whatever it cut half way is gone with them
    assert not before & {r.pid for r in lab.companions["exercises-2"].table}
    assert "never returned from line 4 of average_gradients: `dist.recv(p.grad, src=1 - rank % 2)`" in result.feedback
    assert [case.ran for case in result.cases].count(True) == 1  # the cases after it were not run
    assert lab.run("world_size", stream=False) == {0: 2, 1: 2}
    assert harness.check(lab, harness.solution).passed


def test_the_learners_names_are_left_as_they_were(lab):
    harness.check(lab, "x_kept = rank * 10\n" + harness.solution, seed=3)
    assert lab.pull("x_kept") == {0: 0, 1: 10}
    assert lab.world_size == 2


def test_a_rank_that_dies_is_named_and_the_next_check_gets_a_whole_world(lab):
    dies = """
import os, signal

def average_gradients(model):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
"""
    result = harness.check(lab, dies)
    assert not result.passed
    assert "rank 1's process died during this case" in result.feedback, result.feedback
    assert [case.ran for case in result.cases].count(True) == 1
    assert harness.check(lab, harness.solution).passed
