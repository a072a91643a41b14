"""expert-dispatch: the reference's two all-to-alls and its capacity; the mistakes learners make, each named
(graded by test_exercises_graded.py)."""

from __future__ import annotations

from _exercises import Harness

from distlab.exercises.results import ExerciseResult

harness = Harness("expert-dispatch")


def reference_measures(result: ExerciseResult) -> None:
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


MISTAKES = {
    "no-capacity": (NO_CAPACITY, "came back with the expert's output: keep only the first"),
    "capacity-over-all": (CAPACITY_OVER_ALL, "the capacity was counted over all the tokens"),
    "wrong-rows": (WRONG_ROWS, "put back in the wrong rows"),
    "gather-everything": (GATHER_EVERYTHING, "but the layer also ran all_gather"),
    "next-expert": (NEXT_EXPERT, "not its expert"),
}
