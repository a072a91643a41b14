"""parameter-server: the reference's step is timed; the mistakes learners make, each named (graded by
test_exercises_graded.py); a deadlock is stopped."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

from distlab.exercises.results import ExerciseResult

pytestmark = pytest.mark.cluster

harness = Harness("parameter-server")
lab = learners_lab()


def reference_measures(result: ExerciseResult) -> None:
    assert all(case.measured["step_s"] > 0 for case in result.cases)


# Everything but the one mistake is as in the reference.
_STEP = """
def parameter_server_step(params, grads, lr):
    if rank == 0:
        total = [torch.zeros_like(p) for p in params]
        for worker in range(1, world_size):
            for t in total:
                buf = torch.empty_like(t)
                dist.recv(buf, src=worker)
                t += buf
        with torch.no_grad():
            for p, t in zip(params, total):
                p -= lr * t / {divisor}
        {server_sends}
    else:
        for g in grads:
            dist.send(g, dst=0)
        {worker_receives}
"""
_SENDS = "for w in range(1, world_size):\n            for p in params:\n                dist.send(p, dst=w)"
_RECEIVES = "for p in params:\n            dist.recv(p, src=0)"


def _step(divisor: str = "(world_size - 1)", server_sends: str = _SENDS, worker_receives: str = _RECEIVES) -> str:
    return _STEP.format(divisor=divisor, server_sends=server_sends, worker_receives=worker_receives)


MISTAKES = {
    "mean-over-all-ranks": (_step(divisor="world_size"), "counting the server's own zero gradient"),
    "params-not-sent-back": (_step(server_sends="pass", worker_receives="pass"), "must send the new params back"),
    "workers-step-too": (
        _step(worker_receives=_RECEIVES + "\n        for p, g in zip(params, grads):\n            p -= lr * g"),
        "a double step",
    ),
    "new-tensors-not-in-place": (
        _step(
            worker_receives="for i, p in enumerate(params):\n"
            "            new = torch.empty_like(p)\n"
            "            dist.recv(new, src=0)\n"
            "            params[i] = new"
        ),
        "replaced by a new tensor",
    ),
}


def test_a_deadlock_is_stopped_named_and_both_labs_work_afterwards(lab):
    harness.warm(lab)
    # Every worker waits for params before it sends; the server waits for gradients before it sends.
    deadlock = """
def parameter_server_step(params, grads, lr):
    if rank == 0:
        for worker in range(1, world_size):
            for g in grads:
                dist.recv(torch.empty_like(g), src=worker)
    else:
        for p in params:
            dist.recv(p, src=0)
"""
    result = harness.check(lab, deadlock, case_timeout_s=5)
    assert not result.passed
    assert "never returned from line 5 of parameter_server_step: `dist.recv(torch.empty_like(g), src=worker)`" in (
        result.feedback
    ), result.feedback
    assert [case.ran for case in result.cases].count(True) == 1  # the cases after it were not run
    assert lab.run("world_size", stream=False) == {0: 2, 1: 2}
    assert harness.check(lab, harness.solution).passed
