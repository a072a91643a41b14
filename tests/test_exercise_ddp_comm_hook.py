"""ddp-comm-hook: the mistakes learners make writing DDP's averaging as a hook, each named (graded by
test_exercises_graded.py)."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

harness = Harness("ddp-comm-hook")
lab = learners_lab()

FORGOT_TO_DIVIDE = """
def mean_hook(state, bucket):
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
"""

NEVER_COMMUNICATES = """
def mean_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
"""

RETURNS_THE_TENSOR = """
def mean_hook(state, bucket):
    tensor = bucket.buffer()
    dist.all_reduce(tensor)
    return tensor / world_size
"""

MISTAKES = {
    "forgot-to-divide": (FORGOT_TO_DIVIDE, "the sum over the ranks: divide by the world size"),
    "never-communicates": (NEVER_COMMUNICATES, "this rank's own: the bucket was not all-reduced"),
    "returns-the-tensor": (RETURNS_THE_TENSOR, "torch.futures.Future"),
}


def reference_measures(result):
    # after DDP's rebuild, 25 MB holds the 2-layer model in one bucket; 4 KB cuts the 6-layer one into several
    for case in result.cases:
        if "bucket_cap_mb 25," in case.name:
            assert case.measured["buckets"] == 1, case.name
        if "bucket_cap_mb 0.004," in case.name:
            assert case.measured["buckets"] > 2, case.name
