"""zero-1: the reference passes with about 1/N of Adam's state per rank; the mistakes learners make fail, each named."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

NAME = "zero-1"
harness = Harness(NAME)
lab = learners_lab()


def test_the_reference_solution_passes_with_a_shard_of_the_state_in_every_world(lab):
    result = harness.check(lab, harness.solution)
    assert result.passed, result.feedback
    assert {case.world_size for case in result.cases} == {2, 3, 4}
    for case in result.cases:
        # Two moments of ceil(numel / N) fp32 elements: theory's 8 * numel / N, up to the padding.
        assert 1.0 <= case.measured["ratio_to_theory"] < 1.05, case
        assert case.measured["optimizer_bytes"] < case.measured["unsharded_bytes"] / case.world_size + 64, case


FULL_STATE = """
class Zero1Adam:
    def __init__(self, params, lr):
        self.params = list(params)
        self.adam = torch.optim.Adam(self.params, lr=lr)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= world_size
        self.adam.step()
"""


@pytest.mark.parametrize(
    ("code", "named"),
    [
        (FULL_STATE, "not sharded"),
        (
            harness.changed(
                "        dist.all_gather_single(full, param)\n",
                "        full = self._padded(self.params)\n"
                "        full[self.start : self.start + self.shard] = param\n",
            ),
            "all-gather the updated shards",
        ),
        (harness.changed("        grad /= world_size\n", ""), "the gradients were summed, not averaged"),
        (harness.changed("        self.t += 1\n", ""), "dividing by zero"),
        (
            harness.changed(
                "        m_hat = self.exp_avg / (1 - beta1**self.t)\n"
                "        v_hat = self.exp_avg_sq / (1 - beta2**self.t)\n",
                "        m_hat, v_hat = self.exp_avg, self.exp_avg_sq\n",
            ),
            "no bias correction",
        ),
    ],
    ids=["full-state", "no-all-gather", "not-averaged", "step-count-zero", "no-bias-correction"],
)
def test_each_mistake_fails_with_feedback_that_names_it(lab, code, named):
    result = harness.check(lab, code)
    assert not result.passed
    assert named in str(result), result  # the feedback or a case's row: what the learner sees
    assert result.failures[0].rank is not None
