"""tensor-parallel-mlp: the reference passes; the mistakes learners make fail, each named."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

NAME = "tensor-parallel-mlp"
harness = Harness(NAME)
lab = learners_lab()


def test_the_reference_solution_passes_in_every_world(lab):
    result = harness.check(lab, harness.solution)
    assert result.passed, result.feedback
    assert {case.world_size for case in result.cases} == {2, 4}
    assert all(case.measured == {"all_reduce_forward": 1, "all_reduce_backward": 1} for case in result.cases)


# f left out: forward is right, but each rank's x.grad is its own hidden features' part.
NO_ALL_REDUCE_IN_BACKWARD = harness.changed("        x = _CopyToRanks.apply(x)\n", "")
B2_ON_EVERY_RANK = harness.changed(
    "return _SumOverRanks.apply(hidden @ self.w2.T) + self.b2",
    "return _SumOverRanks.apply(hidden @ self.w2.T + self.b2)",
)
ALL_REDUCE_AFTER_GELU = harness.changed(
    "hidden = torch.nn.functional.gelu(x @ self.w1.T + self.b1)",
    "hidden = _SumOverRanks.apply(torch.nn.functional.gelu(x @ self.w1.T + self.b1))",
).replace("return _SumOverRanks.apply(hidden @ self.w2.T) + self.b2", "return hidden @ self.w2.T + self.b2")
W2_SPLIT_BY_ROWS = harness.changed("w2[:, rows].clone()", "w2.chunk(world_size, 0)[rank].clone()")
# torch's differentiable all-reduce sums the gradient in backward too: g's backward must be the identity.
TORCH_ALL_REDUCE_AS_G = "import torch.distributed.nn\n" + harness.changed(
    "_SumOverRanks.apply(hidden @ self.w2.T)", "torch.distributed.nn.functional.all_reduce(hidden @ self.w2.T)"
)


@pytest.mark.parametrize(
    ("code", "named"),
    [
        (NO_ALL_REDUCE_IN_BACKWARD, "the input's gradient is only this rank's part: all-reduce it in backward"),
        (B2_ON_EVERY_RANK, "every rank adds b2 before the all-reduce"),
        (ALL_REDUCE_AFTER_GELU, "the all-reduce is in the wrong place"),
        (W2_SPLIT_BY_ROWS, "w2 is split by rows"),
        (TORCH_ALL_REDUCE_AS_G, "the forward all-reduce's backward must pass the gradient through unchanged"),
    ],
    ids=["no-all-reduce-in-backward", "b2-on-every-rank", "all-reduce-after-gelu", "w2-split-by-rows", "torch-g"],
)
def test_each_mistake_fails_with_feedback_that_names_it(lab, code, named):
    result = harness.check(lab, code)
    assert not result.passed
    assert named in str(result), result  # the feedback or a case's row: what the learner sees
    assert result.failures[0].rank is not None
