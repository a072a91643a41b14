"""expert-dispatch: the reference passes; the mistakes learners make fail, each named."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

NAME = "expert-dispatch"
harness = Harness(NAME)
lab = learners_lab()


def test_the_reference_solution_passes_in_every_world(lab):
    result = harness.check(lab, harness.solution)
    assert result.passed, result.feedback
    assert {case.world_size for case in result.cases} == {2, 4}
    assert all(case.measured["all_to_alls"] == 2 for case in result.cases)
    assert any(case.measured["dropped"] > 0 for case in result.cases)  # the capacity is really tested


NO_CAPACITY = harness.changed(".nonzero().flatten()[:capacity]", ".nonzero().flatten()")
# Every token keeps its slot: the buffer then needs room for them all (capacity rows no longer suffice).
NO_CAPACITY = NO_CAPACITY.replace(
    "send = torch.zeros(world_size * capacity, d, dtype=x.dtype)",
    "capacity = len(x)\n    send = torch.zeros(world_size * capacity, d, dtype=x.dtype)",
)
CAPACITY_OVER_ALL = harness.changed(
    "kept = (expert_of == e).nonzero().flatten()[:capacity]",
    "kept = (expert_of == e).nonzero().flatten()\n        kept = kept[kept < capacity]",
)
WRONG_ROWS = harness.changed("out[tokens] = back[slots]", "out[tokens] = back[slots.flip(0)]")
GATHER_EVERYTHING = harness.changed(
    "    received = torch.empty_like(send)\n"
    "    dist.all_to_all_single(received, send)  # dispatch: block e to rank e\n",
    "    everyone = [torch.empty_like(send) for _ in range(world_size)]\n"
    "    dist.all_gather(everyone, send)\n"
    "    received = torch.cat([b.view(world_size, capacity, d)[rank] for b in everyone])\n",
)
NEXT_EXPERT = harness.changed(
    "rows.append((t, e * capacity + k))", "rows.append((t, (e + 1) % world_size * capacity + k))"
)


@pytest.mark.parametrize(
    ("code", "named"),
    [
        (NO_CAPACITY, "came back with the expert's output: keep only the first"),
        (CAPACITY_OVER_ALL, "the capacity was counted over all the tokens"),
        (WRONG_ROWS, "put back in the wrong rows"),
        (GATHER_EVERYTHING, "but the layer also ran all_gather"),
        (NEXT_EXPERT, "not its expert"),
    ],
    ids=["no-capacity", "capacity-over-all", "wrong-rows", "gather-everything", "next-expert"],
)
def test_each_mistake_fails_with_feedback_that_names_it(lab, code, named):
    result = harness.check(lab, code)
    assert not result.passed
    assert named in str(result), result  # the feedback or a case's row: what the learner sees
    assert result.failures[0].rank is not None
