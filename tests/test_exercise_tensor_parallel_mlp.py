"""tensor-parallel-mlp: the reference's one all-reduce each way; the mistakes learners make, each named
(graded by test_exercises_graded.py)."""

from __future__ import annotations

from _exercises import Harness

from distlab.exercises.results import ExerciseResult

harness = Harness("tensor-parallel-mlp")


def reference_measures(result: ExerciseResult) -> None:
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
    "_SumOverRanks.apply(hidden @ self.w2.T)",
    "torch.distributed.nn.functional.all_reduce(hidden @ self.w2.T)",
)


MISTAKES = {
    "no-all-reduce-in-backward": (
        NO_ALL_REDUCE_IN_BACKWARD, "the input's gradient is only this rank's part: all-reduce it in backward"
    ),
    "b2-on-every-rank": (B2_ON_EVERY_RANK, "every rank adds b2 before the all-reduce"),
    "all-reduce-after-gelu": (ALL_REDUCE_AFTER_GELU, "the all-reduce is in the wrong place"),
    "w2-split-by-rows": (W2_SPLIT_BY_ROWS, "w2 is split by rows"),
    "torch-g": (TORCH_ALL_REDUCE_AS_G, "the forward all-reduce's backward must pass the gradient through unchanged"),
}
