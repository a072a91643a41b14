"""Live questions: graded against a running lab.

The first tests use a stand-in lab that answers from a table, to check the plumbing without starting
anything. The tests marked ``cluster`` answer every live question on a real 2-rank gloo lab.
"""

from __future__ import annotations

import ast
from typing import Any

import pytest

from distlab import quiz, theory
from distlab.quiz.live import wrap_cell

LIVE = [q for q in quiz.bank() if q.needs_lab]


class _TableLab:
    """Answers ``run`` with ``value(rank)`` for every rank, and remembers the code it was sent."""

    def __init__(self, world_size: int, value: Any) -> None:
        self.world_size = world_size
        self.value = value
        self.sent: list[str] = []

    def run(self, code: str, ranks: Any = None, timeout: float | None = None, record: bool = True) -> dict[int, Any]:
        self.sent.append(code)
        return {rank: self.value(rank) for rank in range(self.world_size)}


def _run_like_a_rank(code: str, namespace: dict[str, Any]) -> Any:
    """Execute ``code`` as a notebook cell in ``namespace`` and return its last expression."""
    tree = ast.parse(code)
    last = tree.body.pop()
    assert isinstance(last, ast.Expr)
    exec(compile(tree, "<cell>", "exec"), namespace)  # noqa: S102 - the bank's own code, as a rank runs it
    return eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)


# --- plumbing, no processes --------------------------------------------------------------------------


def test_the_bank_has_live_questions_of_both_kinds():
    assert {q.response for q in LIVE} == {"numeric", "choice"}
    assert len(LIVE) >= 6


@pytest.mark.parametrize("question", LIVE, ids=[q.id for q in LIVE])
def test_a_live_question_without_a_lab_says_how_to_start_one(question):
    with pytest.raises(ValueError, match=r"this question needs a running lab: run %dist start -n 2 first"):
        question.draw(seed=0)


def test_a_lab_too_small_for_the_question_is_refused():
    question = quiz.bank().get("data-parallelism/live-sum-on-every-rank")
    with pytest.raises(ValueError, match="needs at least 2 ranks and the lab has 1"):
        question.draw(lab=_TableLab(1, lambda rank: 0.0))


def test_the_wrapped_cell_returns_its_last_expression_and_leaves_the_namespace_as_it_was():
    program = wrap_cell("doubled = [x * 2 for x in range(n)]\nsum(doubled)", {"n": 4})
    namespace: dict[str, Any] = {"kept": 1}
    assert _run_like_a_rank(program, namespace) == 12
    assert set(namespace) - {"__builtins__"} == {"kept"}


def test_parameters_reach_the_cell_as_numbers_not_as_text():
    question = quiz.bank().get("data-parallelism/live-sum-on-every-rank")
    lab = _TableLab(2, lambda rank: 0.0)
    attempt = question.draw(lab=lab, params={"scale": 5})
    attempt.answer()
    assert "scale=5" in lab.sent[0]
    assert f"scale = {attempt.params['scale']}" in attempt.prompt


def test_a_numeric_live_question_grades_against_the_value_on_the_asked_rank():
    question = quiz.bank().get("data-parallelism/live-sum-on-every-rank")
    lab = _TableLab(3, lambda rank: 10.0 * rank)
    attempt = question.draw(seed=1, lab=lab)
    assert attempt.rank == 2 and "rank 2" in attempt.prompt  # "last" in a 3-rank lab
    assert attempt.check("20").correct
    assert attempt.check(20.0).correct
    assert not attempt.check("10").correct
    assert len(lab.sent) == 1  # the lab is asked once per attempt


def test_a_live_answer_may_be_a_list_of_numbers():
    question = quiz.bank().get("torch-distributed-api/live-all-gather")
    attempt = question.draw(seed=0, lab=_TableLab(2, lambda rank: [0.0, 3.0]))
    assert attempt.check("0, 3").correct
    assert attempt.check("[0.0, 3.0]").correct
    assert attempt.check([0, 3]).correct
    wrong_length = attempt.check("0, 3, 6")
    assert not wrong_length.correct and "has 2 number(s); you gave 3" in wrong_length.feedback
    unreadable = attempt.check("zero, three")
    assert not unreadable.counted


def test_a_choice_live_question_is_right_when_the_option_matches_what_the_lab_returned():
    question = quiz.bank().get("pitfalls/live-different-seeds")
    for returned in (True, False):
        attempt = question.draw(seed=0, lab=_TableLab(2, lambda rank, r=returned: r))
        right = attempt.answer()
        assert next(o for o in question.options if o.id == right).value is returned
        assert attempt.check(right).correct
        assert not attempt.check(next(o.id for o in question.options if o.id != right)).correct


def test_a_lab_value_no_option_stands_for_is_a_clear_error():
    question = quiz.bank().get("pitfalls/live-different-seeds")
    attempt = question.draw(seed=0, lab=_TableLab(2, lambda rank: "maybe"))
    with pytest.raises(RuntimeError, match="the lab returned 'maybe', which no option stands for"):
        attempt.answer()


def test_a_live_question_without_parameters_can_be_checked_directly():
    question = quiz.bank().get("pitfalls/live-different-seeds")
    assert not question.parameterised
    assert question.check("different", lab=_TableLab(2, lambda rank: False)).correct


def test_the_widget_includes_live_questions_when_given_a_lab_and_grades_them():
    lab = _TableLab(2, lambda rank: False)
    widget = quiz.show("pitfalls", lab=lab, seed=0)
    assert any(q.needs_lab for q in widget.questions)
    assert widget.note.value == ""
    while not widget.attempt.question.needs_lab:
        widget.next_button.click()
    assert "all_gather" in widget.code.value
    widget.submit("different")
    assert "Right" in widget.feedback.value


def test_a_lab_failure_during_check_is_shown_in_the_widget_not_raised():
    class _BrokenLab(_TableLab):
        def run(
            self, code: str, ranks: Any = None, timeout: float | None = None, record: bool = True
        ) -> dict[int, Any]:
            raise RuntimeError("rank 1 died")

    widget = quiz.show("pitfalls", lab=_BrokenLab(2, lambda rank: None), seed=0)
    while not widget.attempt.question.needs_lab:
        widget.next_button.click()
    widget.submit("different")
    assert "Could not check this against the lab: rank 1 died" in widget.feedback.value
    assert widget.score.value == ""


# --- on a real lab ---------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("question", LIVE, ids=[q.id for q in LIVE])
def test_every_live_question_is_answered_right_and_wrong_on_a_real_lab(lab, question):
    for seed in (0, 1):
        attempt = question.draw(seed=seed, lab=lab)
        right = attempt.answer()
        assert attempt.check(right).correct
        if question.response == "choice":
            wrong = next(o.id for o in question.options if o.id != right)
        else:
            wrong = [x + 1 for x in right] if isinstance(right, list) else right + 1
        assert not attempt.check(wrong).correct


@pytest.mark.cluster
def test_live_questions_leave_the_ranks_namespace_as_it_was(lab):
    # The session lab is shared with other tests, which may define `loss` themselves: compare with before.
    names = "sorted(n for n in globals() if not n.startswith('_') or n == '_distlab_quiz_cell')"
    before = lab.run(names)
    question = quiz.bank().get("data-parallelism/live-averaged-gradient")
    question.draw(seed=0, lab=lab).answer()
    assert lab.run(names) == before


@pytest.mark.cluster
def test_live_values_agree_with_theory(lab):
    question = quiz.bank().get("data-loading/live-share-size")
    for size in (11, 24, 49):
        observed = question.draw(lab=lab, params={"dataset_size": size}).answer()
        assert observed == theory.samples_per_rank(size, lab.world_size)

    summed = quiz.bank().get("data-parallelism/live-sum-on-every-rank").draw(lab=lab, params={"scale": 3})
    assert summed.answer() == pytest.approx(3 * lab.world_size * (lab.world_size + 1) / 2)
    mean = quiz.bank().get("data-parallelism/live-averaged-gradient").draw(lab=lab, params={"scale": 4})
    assert mean.answer() == pytest.approx(4 * (lab.world_size + 1) / 2)
