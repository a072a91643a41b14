"""Grading through the Python API: every question answered right and wrong, numeric answers from theory."""

from __future__ import annotations

import itertools
import math

import pytest

from distlab import quiz, theory

OFFLINE = [q for q in quiz.bank() if not q.needs_lab]
NUMERIC = [q for q in quiz.bank() if q.kind == "numeric"]
WITH_UNIT = [q for q in NUMERIC if q.unit]
SEEDS = range(12)


def _ids(questions):
    return [q.id for q in questions]


# --- every question, right and wrong --------------------------------------------------------------


@pytest.mark.parametrize("question", OFFLINE, ids=_ids(OFFLINE))
def test_every_question_accepts_its_right_answer(question):
    for seed in SEEDS:
        attempt = question.draw(seed=seed)
        result = attempt.check(attempt.answer())
        assert result.correct and result.counted, (seed, result)
        assert result.feedback


@pytest.mark.parametrize("question", OFFLINE, ids=_ids(OFFLINE))
def test_every_question_refuses_a_wrong_answer(question):
    for seed in SEEDS:
        attempt = question.draw(seed=seed)
        for wrong in _wrong_answers(question, attempt):
            result = attempt.check(wrong)
            assert not result.correct and result.counted, (seed, wrong, result)
            assert result.feedback.startswith("Not quite")


def _wrong_answers(question, attempt):
    right = attempt.answer()
    if question.kind == "single":
        return [o.id for o in question.options if o.id != right]
    if question.kind == "multiple":
        ids = [o.id for o in question.options]
        return [list(c) for r in range(1, len(ids) + 1) for c in itertools.combinations(ids, r) if set(c) != set(right)]
    if question.kind == "ordering":
        swapped = list(right)
        swapped[0], swapped[1] = swapped[1], swapped[0]
        return [swapped, list(reversed(right))]
    return [right * 1.5 + 1, -right - 1]


def test_single_choice_feedback_is_the_picked_options_own():
    question = quiz.bank().get("pitfalls/collective-behind-if")
    for option in question.options:
        result = question.check(option.id)
        assert result.correct == option.correct
        assert result.feedback.endswith(option.feedback)


def test_multiple_choice_names_wrong_ticks_and_counts_missed_ones_without_naming_them():
    question = quiz.bank().get("why-distribute/good-reasons")
    right = [o for o in question.options if o.correct]
    wrong = next(o for o in question.options if not o.correct)
    result = question.check([right[0].id, wrong.id])
    assert not result.correct
    assert wrong.feedback in result.feedback
    assert f"{len(right) - 1} right options not ticked" in result.feedback
    assert right[1].text not in result.feedback


def test_the_ids_listed_for_an_unreadable_ordering_do_not_give_the_order_away():
    question = quiz.bank().get("training-round/steps-in-order")
    feedback = question.check(["split"]).feedback
    listed = feedback.split("ids: ")[1].rstrip(").").split(", ")
    assert listed == sorted(item.id for item in question.items) != [item.id for item in question.items]


def test_ordering_feedback_counts_the_items_in_place_and_explains_the_first_misplaced():
    question = quiz.bank().get("training-round/steps-in-order")
    order = [item.id for item in question.items]
    order[3], order[4] = order[4], order[3]
    result = question.check(order)
    assert not result.correct
    assert f"{len(order) - 2} of {len(order)} in the right place" in result.feedback
    assert question.items[4].feedback in result.feedback


@pytest.mark.parametrize(
    ("question_id", "answer"),
    [
        ("pitfalls/collective-behind-if", None),
        ("pitfalls/collective-behind-if", "z"),
        ("pitfalls/collective-behind-if", 3),
        ("why-distribute/good-reasons", []),
        ("why-distribute/good-reasons", ["a", "nope"]),
        ("training-round/steps-in-order", ["split", "hold"]),
        ("training-round/steps-in-order", ["split"] * 7),
    ],
)
def test_an_unreadable_answer_is_explained_and_not_counted(question_id, answer):
    result = quiz.bank().get(question_id).check(answer)
    assert not result.correct and not result.counted
    assert "ids:" in result.feedback


@pytest.mark.parametrize("answer", ["", "abc", "12 parsecs", "5 MB", [1, 2], None, True, math.nan])
def test_a_numeric_answer_that_is_not_a_number_in_the_right_unit_is_not_counted(answer):
    attempt = quiz.bank().get("communication-cost/ring-allreduce-time").draw(seed=1)
    result = attempt.check(answer)
    assert not result.correct and not result.counted
    assert result.feedback.endswith(".")


# --- numeric questions: drawn afresh, answered by theory ------------------------------------------


@pytest.mark.parametrize("question", NUMERIC, ids=_ids(NUMERIC))
def test_the_answer_is_the_theory_function_applied_to_the_drawn_numbers(question):
    function = getattr(theory, question.theory)
    specs = {spec.name: spec for spec in question.params}
    for seed in range(25):
        attempt = question.draw(seed=seed)
        # Convert the drawn numbers here, independently of the question's own conversion.
        arguments = {
            name: value
            if isinstance(value, str)
            else [theory.to_base_units(v, specs[name].unit) for v in value]
            if isinstance(value, list)
            else theory.to_base_units(value, specs[name].unit)
            for name, value in attempt.params.items()
        }
        expected = theory.from_base_units(function(**arguments), question.unit)
        assert attempt.answer() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("question", NUMERIC, ids=_ids(NUMERIC))
def test_each_attempt_draws_new_numbers(question):
    prompts = {question.draw(seed=seed).prompt for seed in range(25)}
    assert len(prompts) > 1


@pytest.mark.parametrize("question", WITH_UNIT, ids=_ids(WITH_UNIT))
def test_a_numeric_answer_may_be_typed_with_another_unit_of_the_same_kind(question):
    attempt = question.draw(seed=3)
    base = theory.to_base_units(attempt.answer(), question.unit)
    # A bare number means "in the question's unit", so the other unit must be written out.
    other = next(
        u
        for u, (d, _) in theory.UNITS.items()
        if d == theory.unit_dimension(question.unit) and u not in ("", question.unit)
    )
    assert attempt.check(f"{theory.from_base_units(base, other)!r} {other}").correct


def test_a_parameterised_question_is_checked_through_an_attempt():
    question = quiz.bank().get("batch-and-lr/global-batch")
    with pytest.raises(ValueError, match=r"draws new numbers for every attempt: check an attempt instead, e\.g\."):
        question.check(256)


def test_fixing_a_parameter_that_does_not_exist_is_refused():
    question = quiz.bank().get("batch-and-lr/global-batch")
    with pytest.raises(ValueError, match="has no parameter 'gpus'"):
        question.draw(params={"gpus": 4})


def test_curriculum_worked_numbers_come_out_of_the_quiz():
    bank = quiz.bank()
    global_batch = bank.get("batch-and-lr/global-batch").draw(
        params={"per_device_batch": 8, "devices": 16, "accumulation_steps": 2}
    )
    assert global_batch.answer() == 256
    assert "8 x 16 x 2 = 256" in global_batch.explain()

    ring = bank.get("communication-cost/ring-allreduce-time").draw(
        params={"workers": 4, "size_bytes": 400, "bandwidth_bytes_per_s": 25, "latency_s": 5}
    )
    assert ring.prompt.count("400 MB") == 1 and "25 GB/s" in ring.prompt and "5 us" in ring.prompt
    assert ring.answer() == pytest.approx(24.030)  # 1.5 x 16 ms + 2(N-1) = 6 steps of 5 us
    assert ring.check("24.0").correct and ring.check("24 ms").correct and ring.check("0.024 s").correct

    plain = bank.get("memory-sharding/plain-ddp-state").draw(params={"parameters": 2})
    assert plain.answer() == pytest.approx(32)
    zero3 = bank.get("memory-sharding/zero3-with-activations").draw(
        params={"parameters": 2, "devices": 8, "activation_bytes": 3}
    )
    assert zero3.answer() == pytest.approx(7)
    assert not zero3.check("4").correct


def test_a_typical_mistake_gets_its_own_feedback():
    ring = (
        quiz.bank()
        .get("communication-cost/ring-allreduce-time")
        .draw(params={"workers": 4, "size_bytes": 400, "bandwidth_bytes_per_s": 25, "latency_s": 5})
    )
    once = 400e6 / 25e9 + 3 * 5e-6  # S/B: the buffer sent once, as if N were 2
    result = ring.check(f"{once * 1e3} ms")
    assert not result.correct and "2(N-1)/N" in result.feedback

    busbw = (
        quiz.bank()
        .get("communication-cost/bus-bandwidth")
        .draw(params={"size_bytes": 1024, "workers": 4, "time_s": 40})
    )
    result = busbw.check(str(1024e6 / 40e-3 / 1e9))
    assert not result.correct and "That is algbw" in result.feedback


def test_an_answer_off_by_a_thousand_is_told_to_check_the_units():
    attempt = quiz.bank().get("communication-cost/ring-allreduce-time").draw(seed=2)
    result = attempt.check(attempt.answer() * 1000)
    assert "check the units" in result.feedback


def test_too_high_and_too_low_are_told_apart():
    attempt = quiz.bank().get("scaling/time-grows-with-batches").draw(seed=2)
    assert "Too high" in attempt.check(attempt.answer() * 1.3).feedback
    assert "Too low" in attempt.check(attempt.answer() * 0.7).feedback


def test_answers_within_the_tolerance_count_as_right():
    attempt = quiz.bank().get("communication-cost/ring-allreduce-time").draw(seed=4)
    assert attempt.check(attempt.answer() * 1.009).correct
    assert not attempt.check(attempt.answer() * 1.02).correct


def test_same_seed_same_attempt():
    question = quiz.bank().get("sync-async/slowest-worker")
    assert question.draw(seed=7).prompt == question.draw(seed=7).prompt
    assert question.draw(seed=7).answer() == question.draw(seed=7).answer()


def test_prompts_show_drawn_numbers_with_units_and_explanations_fill_in_the_answer():
    attempt = quiz.bank().get("sync-async/slowest-worker").draw(seed=1)
    times = attempt.params["worker_times_s"]
    assert all(f"{t} ms" in attempt.prompt for t in times)
    assert f"{max(times)} ms" in attempt.explain()
    assert "{" not in attempt.prompt + attempt.hint + attempt.explain()


def test_choice_attempts_shuffle_the_options_but_grade_by_id():
    question = quiz.bank().get("memory-sharding/fsdp")
    orders = {tuple(o.id for o in question.draw(seed=seed).choices) for seed in range(10)}
    assert len(orders) > 1
    assert all(question.draw(seed=seed).check("a").correct for seed in range(10))


def test_ordering_attempts_never_show_the_items_already_in_order():
    question = quiz.bank().get("training-round/steps-in-order")
    right = question.draw().answer()
    assert all(tuple(o.id for o in question.draw(seed=seed).choices) != right for seed in range(50))


def test_answer_text_reads_as_the_right_answer():
    single = quiz.bank().get("memory-sharding/fsdp").draw()
    assert single.answer_text().startswith("PyTorch's form of ZeRO stage 3")
    ordering = quiz.bank().get("scaling/measuring").draw()
    assert ordering.answer_text().startswith("Time a fixed number of steps on 1 worker -> ")
