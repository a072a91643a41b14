"""zero-1: the reference keeps about 1/N of Adam's state per rank; the mistakes learners make, each named
(graded by test_exercises_graded.py)."""

from __future__ import annotations

from _exercises import Harness

from distlab.exercises.results import ExerciseResult

harness = Harness("zero-1")


def reference_measures(result: ExerciseResult) -> None:
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


MISTAKES = {
    "full-state": (FULL_STATE, "not sharded"),
    "no-all-gather": (
        harness.changed(
            "        dist.all_gather_single(full, param)\n",
            "        full = self._padded(self.params)\n"
            "        full[self.start : self.start + self.shard] = param\n",
        ),
        "all-gather the updated shards",
    ),
    "not-averaged": (harness.changed("        grad /= world_size\n", ""), "the gradients were summed, not averaged"),
    "step-count-zero": (harness.changed("        self.t += 1\n", ""), "dividing by zero"),
    "no-bias-correction": (
        harness.changed(
            "        m_hat = self.exp_avg / (1 - beta1**self.t)\n"
            "        v_hat = self.exp_avg_sq / (1 - beta2**self.t)\n",
            "        m_hat, v_hat = self.exp_avg, self.exp_avg_sq\n",
        ),
        "no bias correction",
    ),
}
