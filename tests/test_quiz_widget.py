"""The quiz widget, driven from Python the way a learner drives it: fill in the input, press Check."""

from __future__ import annotations

import ipywidgets as widgets
import pytest

from distlab import quiz


def _quiz_at(kind: str, topic: str, seed: int = 0):
    """A quiz on ``topic`` moved forward to its first question of ``kind``."""
    widget = quiz.show(topic, seed=seed)
    while widget.attempt.kind != kind:
        widget.next_button.click()
    return widget


# --- show() checks its arguments before showing anything ------------------------------------------


def test_unknown_topic_lists_the_topics():
    with pytest.raises(ValueError) as error:
        quiz.show("comms")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("unknown topic 'comms'")
    assert all(topic in message for topic in quiz.TOPICS)


def test_a_near_miss_topic_gets_a_suggestion():
    with pytest.raises(ValueError, match="did you mean 'communication-cost'"):
        quiz.show("comunication-cost")


def test_topics_may_be_given_by_number_or_in_any_case():
    assert quiz.show(6, seed=0).topic == "communication-cost"
    assert quiz.show("6", seed=0).topic == "communication-cost"
    assert quiz.show("Communication-Cost", seed=0).topic == "communication-cost"
    with pytest.raises(ValueError, match="unknown topic '16'"):
        quiz.show("16")


def test_bad_difficulty_is_refused_with_the_levels():
    with pytest.raises(ValueError, match="unknown difficulty 'expert'; use easy, medium or hard"):
        quiz.show("scaling", difficulty="expert")


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "5"])
def test_n_must_be_a_positive_whole_number(n):
    with pytest.raises(ValueError, match=r"the number of questions must be (a whole number|>= 1), like n=5"):
        quiz.show("scaling", n=n)


def test_n_and_difficulty_choose_the_questions():
    widget = quiz.show("communication-cost", n=2, difficulty="medium", seed=3)
    assert len(widget.questions) == 2
    assert all(q.difficulty == "medium" and q.topic == "communication-cost" for q in widget.questions)
    assert len(quiz.show("scaling", n=1000, seed=0).questions) == len(quiz.bank().select("scaling"))


def test_without_a_lab_live_questions_are_left_out_and_the_learner_is_told():
    widget = quiz.show("data-parallelism", seed=0)
    assert not any(q.needs_lab for q in widget.questions)
    assert "live questions on this topic need a running lab" in widget.note.value
    assert "%dist start -n 2" in widget.note.value


def test_a_difficulty_with_nothing_left_to_ask_says_so():
    # data-loading's easy questions are not live, but training-round has no hard questions at all.
    assert not quiz.bank().select("training-round", "hard")
    with pytest.raises(ValueError, match="there are no hard questions on training-round"):
        quiz.show("training-round", difficulty="hard")


def test_show_returns_a_widget_built_from_standard_ipywidgets_only():
    widget = quiz.show("scaling", seed=0)
    assert isinstance(widget, widgets.VBox)

    def walk(w):
        yield w
        for child in getattr(w, "children", ()):
            yield from walk(child)

    assert all(type(w).__module__.startswith(("ipywidgets", "distlab")) for w in walk(widget))


def test_the_same_seed_shows_the_same_quiz():
    first, second = quiz.show("scaling", seed=11), quiz.show("scaling", seed=11)
    assert [q.id for q in first.questions] == [q.id for q in second.questions]
    assert first.prompt.value == second.prompt.value


# --- the Check button, for each kind of input -----------------------------------------------------


def test_check_button_grades_a_single_choice_answer():
    widget = _quiz_at("single", "memory-sharding")
    widget.view.buttons.value = widget.attempt.answer()
    widget.check_button.click()
    assert "Right" in widget.feedback.value
    assert widget.score.value == "Score: 1 / 1 right at the first try"
    assert widget.explanation.value
    assert widget.check_button.disabled and widget.view.buttons.disabled


def test_check_button_grades_ticked_boxes():
    widget = _quiz_at("multiple", "memory-sharding")
    for option_id in widget.attempt.answer():
        widget.view.boxes[option_id].value = True
    widget.check_button.click()
    assert "Right" in widget.feedback.value


def test_check_button_grades_typed_numbers_in_the_unit_shown():
    widget = _quiz_at("numeric", "communication-cost")
    assert widget.attempt.unit in {child.value for child in widget.view.widget.children[1:]}
    widget.view.text.value = f"{widget.attempt.answer():.6g}"
    widget.check_button.click()
    assert "Right" in widget.feedback.value


def test_move_buttons_put_an_ordering_in_order_then_check_grades_it():
    widget = _quiz_at("ordering", "scaling")
    view, target = widget.view, list(widget.attempt.answer())
    for position, item in enumerate(target):
        view.list.value = item
        while view.read().index(item) > position:
            view.up_button.click()
    assert view.read() == target
    widget.check_button.click()
    assert "Right" in widget.feedback.value


def test_move_down_moves_the_selected_item_and_stops_at_the_end():
    view = _quiz_at("ordering", "scaling").view
    first = view.read()[0]
    view.list.value = first
    view.down_button.click()
    assert view.read()[1] == first
    for _ in range(10):
        view.down_button.click()
    assert view.read()[-1] == first


def test_a_wrong_answer_keeps_the_question_open_and_counts_against_the_first_try():
    widget = _quiz_at("single", "pitfalls")
    wrong = next(o.id for o in widget.attempt.question.options if not o.correct)
    widget.submit(wrong)
    assert "Not quite" in widget.feedback.value
    assert not widget.check_button.disabled
    assert widget.explanation.value == ""
    widget.submit(widget.attempt.answer())
    assert "Right" in widget.feedback.value
    assert widget.score.value == "Score: 0 / 1 right at the first try"


def test_checking_with_nothing_picked_explains_and_counts_nothing():
    widget = _quiz_at("single", "pitfalls")
    widget.check_button.click()
    assert "Pick the option" in widget.feedback.value
    assert widget.score.value == ""
    assert not quiz.progress_path().exists()


def test_hint_and_show_answer_buttons():
    widget = _quiz_at("numeric", "scaling")
    widget.hint_button.click()
    assert widget.attempt.hint.split()[0] in widget.hint.value
    widget.reveal_button.click()
    assert widget.attempt.answer_text() in widget.feedback.value
    assert widget.explanation.value
    assert widget.score.value == "Score: 0 / 1 right at the first try"
    assert widget.check_button.disabled


def test_what_the_learner_typed_is_escaped_before_it_is_shown():
    widget = _quiz_at("numeric", "pitfalls")
    widget.submit("<b>24</b>")
    assert "Cannot read" in widget.feedback.value
    assert "<b>" not in widget.feedback.value and "&lt;b&gt;" in widget.feedback.value


def test_next_goes_through_the_questions_and_finish_shows_mastery():
    widget = quiz.show("scaling", n=3, seed=5)
    for index in range(3):
        assert f"question {index + 1} of 3" in widget.header.value
        widget.submit(widget.attempt.answer())
        widget.next_button.click()
    assert "done" in widget.header.value
    assert "3 of 3 right at the first try" in widget.prompt.value
    assert f"3 of {len(quiz.bank().select('scaling'))} questions" in widget.prompt.value
    assert widget.next_button.disabled and widget.view is None


def test_a_progress_file_that_cannot_be_written_is_reported_beside_the_verdict(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("", encoding="utf-8")
    monkeypatch.setenv("DISTLAB_QUIZ_PROGRESS", str(blocker / "progress.json"))
    with pytest.warns(UserWarning, match="cannot read quiz progress .* set DISTLAB_QUIZ_PROGRESS to a writable file"):
        widget = _quiz_at("single", "fault-tolerance")
        widget.submit(widget.attempt.answer())
    assert "Right" in widget.feedback.value
    assert "Progress not saved" in widget.feedback.value
    assert widget.score.value == "Score: 1 / 1 right at the first try"


def test_answers_given_in_the_widget_are_saved_as_progress():
    widget = _quiz_at("single", "fault-tolerance")
    widget.submit(widget.attempt.answer())
    row = quiz.summary()["fault-tolerance"]
    assert (row.answered, row.mastered) == (1, 1)


def test_questions_not_yet_mastered_come_first():
    first = quiz.show("fault-tolerance", seed=1)
    mastered = []
    for _ in first.questions[:3]:
        first.submit(first.attempt.answer())
        mastered.append(first.attempt.id)
        first.next_button.click()
    again = quiz.show("fault-tolerance", seed=1)
    assert {q.id for q in again.questions[-3:]} == set(mastered)


def test_options_too_long_for_a_button_are_written_out_above_lettered_buttons():
    # ipywidgets gives a radio button one line: a longer label wraps over the next button.
    from distlab.quiz.widget import _ONE_LINE

    found = {}
    for question in quiz.bank().select("data-parallelism") + quiz.bank().select("scaling"):
        if question.kind == "single":
            found.setdefault(any(len(o.text) > _ONE_LINE for o in question.options), question)
    assert set(found) == {True, False}, "the bank has single-choice questions of both kinds"
    for long, question in found.items():
        widget = quiz.show(question.topic, n=1000, seed=0)
        while widget.attempt.question.id != question.id:
            widget.next_button.click()
        buttons = widget.view.buttons
        labels = [label for label, _ in buttons.options]
        texts = {o.id: o.text for o in question.options}
        if long:
            assert labels == [f"({letter})" for letter in "abcdefgh"[: len(labels)]]
            written = widget.view.widget.children[0]
            assert isinstance(written, widgets.HTML)
            # every option's text is shown, in the order of the buttons that stand for it
            places = [written.value.index(f"({letter})") for letter in "abcdefgh"[: len(labels)]]
            assert places == sorted(places)
            shown = written.value
            assert all(texts[option_id][:40].replace("'", "&#x27;") in shown for _, option_id in buttons.options)
        else:
            assert labels == [texts[option_id] for _, option_id in buttons.options]
            assert widget.view.widget is buttons
        # a letter picks its option: the answer is the option's id either way
        buttons.value = widget.attempt.answer()
        widget.check_button.click()
        assert "Right" in widget.feedback.value
