"""pipeline-1f1b: the reference's bubble is theory's; the mistakes learners make, each named (graded by
test_exercises_graded.py); blocking sends on one side keep the bubble; a timed bubble on one core."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

from distlab.exercises.results import ExerciseResult

harness = Harness("pipeline-1f1b")
lab = learners_lab()


def reference_measures(result: ExerciseResult) -> None:
    assert all(case.measured["in_flight_stage_0"] == 2 for case in result.cases)
    assert all(case.measured["in_flight_stage_1"] == 1 for case in result.cases)
    # 1F1B's order, laid out, idles exactly as long as theory says: (p-1)/(m+p-1).
    assert all(case.measured["bubble_of_order"] == case.measured["bubble_theory"] for case in result.cases)
    timed = [case for case in result.cases if "bubble_stage_0" in case.measured]
    assert len(timed) == 1
    assert timed[0].measured["bubble_theory"] == pytest.approx(1 / 9, abs=1e-4)  # p = 2, m = 8
    assert 0 <= timed[0].measured["bubble_stage_0"] <= 1


NOT_DIVIDED_BY_M = harness.changed("loss = loss_fn(stage(x), targets[i]) / m", "loss = loss_fn(stage(x), targets[i])")
RECEIVED_WITHOUT_REQUIRES_GRAD = harness.changed(
    "        x.requires_grad_()  # so that backward computes the gradient stage 0 needs\n", ""
)
GPIPE = harness.changed(
    "        warmup = min(2, m)  # p - stage forwards before the first backward", "        warmup = m"
)

# 1F1B's order on each stage, but stage 0 sends each activation only when it wants the gradient back:
# the stages take turns, and the pipeline idles half the step.
SENDS_LATE = harness.changed(
    """            outputs[i] = stage(micro_batches[i])
            # isend: go on with the next forward while the activation travels; wait for it before returning.
            activation = outputs[i].detach()
            sends.append((dist.isend(activation, dst=1), activation))
""",
    """            outputs[i] = stage(micro_batches[i])
""",
).replace(
    """            grad = torch.empty(activation_shape)
            dist.recv(grad, src=1)""",
    """            dist.send(outputs[i].detach(), dst=1)
            grad = torch.empty(activation_shape)
            dist.recv(grad, src=1)""",
)
# Every forward, then every activation sent, then every backward: stage 1 waits for the whole first pass.
_STAGE_0_ENDS = "        return None\n"
_REFERENCE_STAGE_0 = harness.solution[
    harness.solution.index("    if rank == 0:") : harness.solution.index(_STAGE_0_ENDS) + len(_STAGE_0_ENDS)
]
ALL_FORWARDS_FIRST = harness.changed(
    _REFERENCE_STAGE_0,
    """    if rank == 0:
        outputs = [stage(x) for x in micro_batches]
        for out in outputs:
            dist.send(out.detach(), dst=1)
        for out in outputs:
            grad = torch.empty(activation_shape)
            dist.recv(grad, src=1)
            out.backward(grad)
        return None
""",
)


MISTAKES = {
    "not-divided-by-m": (NOT_DIVIDED_BY_M, "the gradient is 2 times the unsplit model's"),
    "received-without-requires-grad": (
        RECEIVED_WITHOUT_REQUIRES_GRAD, "set requires_grad on the received activation and send its .grad back"
    ),
    "gpipe": (GPIPE, "that is GPipe: all forwards before any backward keeps m = 3 micro-batches in flight"),
    "sends-late": (
        SENDS_LATE,
        "stage 0 sent activation 0 only after F1, keeping stage 1 waiting: laid out from the order of the "
        "forwards, backwards and messages (a forward one unit of time, a backward two, messages free), the "
        "pipeline idles 50% of the step where 1F1B's theory is 33%",
    ),
    "all-forwards-first": (ALL_FORWARDS_FIRST, "stage 0 sent activation 0 only after F1, F2, keeping stage 1 waiting"),
}


@pytest.mark.cluster
def test_blocking_sends_on_one_side_keep_1f1bs_bubble(lab):
    # gloo's send returns once the receive is posted; in 1F1B's order stage 0 waits there no longer than
    # it would for the gradient anyway, so the laid-out bubble is still theory's.
    blocking = harness.changed(
        "sends.append((dist.isend(activation, dst=1), activation))", "dist.send(activation, dst=1)"
    ).replace("for request, _ in sends:", "for request, _ in []:")
    result = harness.check(lab, blocking)
    assert result.passed, result.feedback
    assert all(case.measured["bubble_of_order"] == case.measured["bubble_theory"] for case in result.cases)


def test_a_timed_bubble_on_one_shared_core_is_said_to_be_unmeasurable_not_failed():
    from distlab.exercises.pipeline_1f1b.grader import _timed_note

    shared = [{"idle": 0.5, "cores": [0]}, {"idle": 0.5, "cores": [0]}]
    assert "the two stages share one core here, so the time measured cannot show the bubble" in _timed_note(
        shared, 0, 8, 1 / 9
    )
    apart = [{"idle": 0.3, "cores": [0]}, {"idle": 0.3, "cores": [1]}]
    assert "share one core" not in _timed_note(apart, 0, 8, 1 / 9)
