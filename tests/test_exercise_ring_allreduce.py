"""ring-allreduce: the reference's ring is measured against theory; the mistakes learners make, each named
(graded by test_exercises_graded.py); the grader puts torch.distributed back; a deadlock is stopped."""

from __future__ import annotations

import re

import pytest
from _exercises import Harness, learners_lab

from distlab.exercises.results import ExerciseResult

pytestmark = pytest.mark.cluster

harness = Harness("ring-allreduce", seed=11)
lab = learners_lab()
# The wrong solutions are graded at 3 ranks alone: every mistake below shows there (sending the whole
# tensor to every peer costs no more than a ring at 2 ranks), and it spares two restarts per check.
MISTAKES_GRADED_AT = (3,)


@pytest.fixture
def three_ranks_only(monkeypatch):
    harness.graded_only_at(monkeypatch, *MISTAKES_GRADED_AT)


def reference_measures(result: ExerciseResult) -> None:
    timed = [case for case in result.cases if "timed" in case.name]
    assert len(timed) == 3
    for case in timed:
        n = case.world_size
        assert case.measured["ring_s"] > 0 and case.measured["all_reduce_s"] > 0
        # tensor_split's chunks differ by one element at most: the count is the theory's within N-1 chunks' rounding
        assert abs(case.measured["sent_bytes"] - case.measured["theory_bytes"]) <= 2 * (n - 1) * 4
        assert "dist.all_reduce" in case.message


USES_ALL_REDUCE = """
def ring_all_reduce(tensor):
    dist.all_reduce(tensor)
"""

# Only the all-gather phase: each rank's chunk goes around the ring, nothing is ever added.
FORGETS_TO_REDUCE = """
def ring_all_reduce(tensor):
    n, right, left = world_size, (rank + 1) % world_size, (rank - 1) % world_size
    chunks = list(tensor.view(-1).tensor_split(n))
    for step in range(n - 1):
        request = dist.isend(chunks[(rank + 1 - step) % n], right)
        dist.recv(chunks[(rank - step) % n], left)
        request.wait()
"""

# The all-gather starts from chunk `rank`, not from the chunk this rank finished reducing, `rank + 1`.
OFF_BY_ONE_IN_THE_ALL_GATHER = """
def ring_all_reduce(tensor):
    n, right, left = world_size, (rank + 1) % world_size, (rank - 1) % world_size
    chunks = list(tensor.view(-1).tensor_split(n))
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        out, into = (rank - step) % n, (rank - step - 1) % n
        received = incoming[: chunks[into].numel()]
        request = dist.isend(chunks[out], right)
        dist.recv(received, left)
        request.wait()
        chunks[into] += received
    for step in range(n - 1):
        request = dist.isend(chunks[(rank - step) % n], right)
        dist.recv(chunks[(rank - step - 1) % n], left)
        request.wait()
"""

# The reduce-scatter stops a step short (range(n - 2)): no chunk holds the full sum when the all-gather starts.
REDUCE_SCATTER_A_STEP_SHORT = harness.changed("for step in range(n - 1):", "for step in range(n - 2):", 1)

WHOLE_TENSOR_TO_EVERYONE = """
def ring_all_reduce(tensor):
    mine = tensor.clone()
    requests = [dist.isend(mine, peer) for peer in range(world_size) if peer != rank]
    incoming = torch.empty_like(tensor)
    for peer in range(world_size):
        if peer != rank:
            dist.recv(incoming, peer)
            tensor += incoming
    for request in requests:
        request.wait()
"""


MISTAKES = {
    "uses-all-reduce": (USES_ALL_REDUCE, "used dist.all_reduce: build it from send/recv"),
    "forgets-to-reduce": (FORGETS_TO_REDUCE, "sent only one phase's bytes: the reduce-scatter phase is missing"),
    "off-by-one-in-the-all-gather": (
        OFF_BY_ONE_IN_THE_ALL_GATHER,
        "passes on chunks that were not fully reduced: an off-by-one in its chunk index",
    ),
    "reduce-scatter-a-step-short": (REDUCE_SCATTER_A_STEP_SHORT, "passes on chunks that were not fully reduced"),
    "whole-tensor-to-everyone": (WHOLE_TENSOR_TO_EVERYONE, "sends the whole tensor to every rank: that is not a ring"),
}


def test_the_grader_puts_torch_distributed_back_after_a_failing_check(lab, three_ranks_only):
    assert not harness.check(lab, USES_ALL_REDUCE).passed
    grader = harness.grader_lab(lab, 3)
    # CPU ranks on gloo whatever the learner's lab asked (auto here): on one GPU, NCCL has too few.
    assert (lab.requested_backend, grader.requested_backend, grader.backend) == ("auto", "gloo", "gloo")
    restored = "all(getattr(dist, f) is getattr(dist.distributed_c10d, f) for f in ('all_reduce', 'send', 'isend'))"
    assert grader.run(restored, stream=False) == {0: True, 1: True, 2: True}


DEADLOCK = """
def ring_all_reduce(tensor):
    for step in range(world_size - 1):
        dist.recv(tensor, (rank - 1) % world_size)
        dist.send(tensor, (rank + 1) % world_size)
"""


def test_a_deadlock_is_stopped_named_and_both_labs_work_afterwards(lab, three_ranks_only):
    harness.warm(lab)
    result = harness.check(lab, DEADLOCK, case_timeout_s=5)
    assert not result.passed
    assert "never returned from line 3 of ring_all_reduce: `dist.recv(tensor, (rank - 1) % world_size)`" in (
        result.feedback
    )
    assert [case.ran for case in result.cases].count(True) == 1  # the cases after it were not run
    assert lab.run("world_size", stream=False) == {0: 2, 1: 2}
    assert harness.check(lab, harness.solution).passed


def test_a_deadlock_that_gloo_times_out_first_ends_the_check_at_its_first_case(lab, three_ranks_only):
    # gloo's receive gives up at the grader's group timeout (tens of seconds), before this case's deadline,
    # every rank raising. That is the hang too: named, and no later case waits as long again.
    harness.warm(lab)
    result = harness.check(lab, DEADLOCK, case_timeout_s=600)
    assert not result.passed
    assert "never returned from line 3 of ring_all_reduce: `dist.recv(tensor, (rank - 1) % world_size)`" in (
        result.feedback
    )
    assert re.search(r"gloo gave up waiting after \d+ s: a deadlock\?", result.feedback), result.feedback
    assert [case.ran for case in result.cases].count(True) == 1
    assert harness.check(lab, harness.solution).passed
