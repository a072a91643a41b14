"""The quiz as ipywidgets: question, answer input, Check, feedback, hint, explanation, score.

Only standard widgets, no HTML + JavaScript of our own: it renders wherever ipywidgets does, and every
button can be pressed from Python (``quiz.check_button.click()``), which is how the tests drive it.
Text shown in ``HTML`` widgets is escaped first.
"""

from __future__ import annotations

import html
import random
import re
from collections.abc import Iterable, Sequence

import ipywidgets as widgets

from .loader import bank
from .model import Attempt, CheckResult, LabLike, Option, Question
from .progress import Progress
from .topics import TOPICS

__all__ = ["QuizWidget"]


def _html(text: str) -> str:
    """Escaped text with `code` spans and line breaks."""
    escaped = html.escape(text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped).replace("\n", "<br>")


_WIDE = {"width": "100%"}
#: ipywidgets gives each radio button and check box one line's height: a longer label wraps onto the
#: row below and covers it (and the browser then clicks the text, not the button). Options longer
#: than this are written out above buttons that carry only their letters.
_ONE_LINE = 70


def _labels(choices: Sequence[Option]) -> tuple[list[str], widgets.Widget | None]:
    """The buttons' labels, and the options written out above them where one is too long for a label."""
    if all(len(o.text) <= _ONE_LINE for o in choices):
        return [o.text for o in choices], None
    letters = [f"({chr(ord('a') + i)})" for i in range(len(choices))]
    text = "".join(f"<div style='margin: 0.2em 0'>{letter} {_html(o.text)}</div>"
                   for letter, o in zip(letters, choices))
    return letters, widgets.HTML(text, layout=widgets.Layout(**_WIDE))


def _iterable(answer: object) -> Iterable[object]:
    """``answer``, which must be iterable (option ids): refused as ``iter`` would refuse it."""
    if not isinstance(answer, Iterable):
        raise TypeError(f"'{type(answer).__name__}' object is not iterable")
    return answer


class _ChoiceView:
    """One option of several (radio buttons)."""

    def __init__(self, choices: Sequence[Option]) -> None:
        labels, written = _labels(choices)
        self.buttons = widgets.RadioButtons(
            options=[(label, o.id) for label, o in zip(labels, choices)], value=None, layout=widgets.Layout(**_WIDE)
        )
        self.widget: widgets.Widget = self.buttons if written is None else widgets.VBox([written, self.buttons])

    def read(self) -> str | None:
        picked: str | None = self.buttons.value  # an option's id, or None before one is picked
        return picked

    def set(self, answer: object) -> None:
        self.buttons.value = answer

    def disable(self) -> None:
        self.buttons.disabled = True


class _TickView:
    """Every right option of several (check boxes)."""

    def __init__(self, choices: Sequence[Option]) -> None:
        labels, written = _labels(choices)
        self.boxes = {
            o.id: widgets.Checkbox(description=label, value=False, indent=False, layout=widgets.Layout(**_WIDE))
            for label, o in zip(labels, choices)
        }
        self.widget = widgets.VBox(([written] if written is not None else []) + list(self.boxes.values()))

    def read(self) -> list[str]:
        return [option_id for option_id, box in self.boxes.items() if box.value]

    def set(self, answer: object) -> None:
        chosen = set(_iterable(answer))
        for option_id, box in self.boxes.items():
            box.value = option_id in chosen

    def disable(self) -> None:
        for box in self.boxes.values():
            box.disabled = True


class _NumberView:
    """A number, in the unit shown beside the box."""

    def __init__(self, unit: str) -> None:
        self.text = widgets.Text(placeholder="e.g. 24" if unit else "a number", layout=widgets.Layout(width="16em"))
        self.widget = widgets.HBox([self.text, widgets.Label(unit)])

    def read(self) -> str:
        typed: str = self.text.value
        return typed

    def set(self, answer: object) -> None:
        self.text.value = ", ".join(map(str, answer)) if isinstance(answer, (list, tuple)) else str(answer)

    def disable(self) -> None:
        self.text.disabled = True


class _OrderView:
    """Items put in order by selecting one and moving it up or down."""

    def __init__(self, choices: Sequence[Option]) -> None:
        self.list = widgets.Select(
            options=[(o.text, o.id) for o in choices], rows=len(choices), layout=widgets.Layout(**_WIDE)
        )
        self.up_button = widgets.Button(description="Move up", icon="arrow-up")
        self.down_button = widgets.Button(description="Move down", icon="arrow-down")
        self.up_button.on_click(lambda _: self._move(-1))
        self.down_button.on_click(lambda _: self._move(+1))
        self.widget = widgets.VBox([self.list, widgets.HBox([self.up_button, self.down_button])])

    def read(self) -> list[str]:
        return [option_id for _, option_id in self.list.options]

    def set(self, answer: object) -> None:
        labels = {option_id: label for label, option_id in self.list.options}
        self.list.options = [(labels[option_id], option_id) for option_id in _iterable(answer)]

    def _move(self, step: int) -> None:
        order = list(self.list.options)
        selected = self.list.value
        position = [option_id for _, option_id in order].index(selected) if selected is not None else -1
        target = position + step
        if position < 0 or not 0 <= target < len(order):
            return
        order[position], order[target] = order[target], order[position]
        self.list.options = order
        self.list.value = selected

    def disable(self) -> None:
        for control in (self.list, self.up_button, self.down_button):
            control.disabled = True


_View = _ChoiceView | _TickView | _NumberView | _OrderView


def _view_for(attempt: Attempt) -> _View:
    question = attempt.question
    if question.kind == "multiple":
        return _TickView(attempt.choices)
    if question.kind == "ordering":
        return _OrderView(attempt.choices)
    if attempt.choices:  # single choice, and live questions answered by picking an option
        return _ChoiceView(attempt.choices)
    return _NumberView(attempt.unit)


class QuizWidget(widgets.VBox):
    """A run through ``questions``, one at a time. Answers are graded in Python and saved to the progress file."""

    def __init__(
        self,
        questions: Sequence[Question],
        *,
        topic: str,
        lab: LabLike | None = None,
        seed: int | None = None,
        progress: Progress | None = None,
        note: str = "",
    ) -> None:
        self.questions = tuple(questions)
        self.topic = topic
        self.lab = lab
        self.progress = progress or Progress()
        self.first_tries: dict[str, bool] = {}  # question id -> right at the first counted answer
        self.index = -1
        self.attempt: Attempt | None = None
        self.view: _View | None = None
        self._rng = random.Random(seed)

        self.header = widgets.HTML()
        self.prompt = widgets.HTML()
        self.code = widgets.HTML()
        self.answer_area = widgets.Box()
        self.check_button = widgets.Button(description="Check", button_style="primary", icon="check")
        self.hint_button = widgets.Button(description="Hint", icon="lightbulb-o")
        self.reveal_button = widgets.Button(description="Show answer", icon="eye")
        self.next_button = widgets.Button(description="Next", icon="arrow-right")
        self.feedback = widgets.HTML()
        self.hint = widgets.HTML()
        self.explanation = widgets.HTML()
        self.score = widgets.Label()
        self.note = widgets.HTML(_html(note))

        self.check_button.on_click(lambda _: self._check())
        self.hint_button.on_click(lambda _: self._show_hint())
        self.reveal_button.on_click(lambda _: self._reveal())
        self.next_button.on_click(lambda _: self._next())
        buttons = widgets.HBox([self.check_button, self.hint_button, self.reveal_button, self.next_button])
        super().__init__(
            [
                self.header,
                self.prompt,
                self.code,
                self.answer_area,
                buttons,
                self.feedback,
                self.hint,
                self.explanation,
                self.score,
                self.note,
            ],
            layout=widgets.Layout(max_width="52em"),
        )
        self._go_to(0)

    # -- navigation ----------------------------------------------------------------------------------

    def _go_to(self, index: int) -> None:
        self.index = index
        question = self.questions[index]
        with self.hold_sync():
            for output in (self.feedback, self.hint, self.explanation, self.code):
                output.value = ""
            self.header.value = _html(
                f"{TOPICS.get(self.topic, self.topic)} · question {index + 1} of {len(self.questions)} · "
                f"{question.difficulty}"
            )
            try:
                self.attempt = question.draw(self._rng.randrange(2**32), lab=self.lab)
            except Exception as error:  # noqa: BLE001 - a lab gone wrong must not break the whole quiz
                self.attempt, self.view = None, None
                self.prompt.value = ""
                self.answer_area.children = ()
                self.feedback.value = _html(f"This question cannot be shown now: {error}. Press Next.")
                self._enable(check=False)
                return
            self.view = _view_for(self.attempt)
            self.prompt.value = _html(self.attempt.prompt)
            if self.attempt.code:
                self.code.value = f"<pre>{html.escape(self.attempt.code)}</pre>"
            self.answer_area.children = (self.view.widget,)
            self._enable(check=True)
            self._update_score()

    def _next(self) -> None:
        if self.index + 1 < len(self.questions):
            self._go_to(self.index + 1)
        else:
            self._finish()

    def _finish(self) -> None:
        right = sum(self.first_tries.values())
        row = self.progress.summary(bank())[self.topic]
        with self.hold_sync():
            self.attempt, self.view = None, None
            self.answer_area.children = ()
            for output in (self.code, self.feedback, self.hint, self.explanation):
                output.value = ""
            self.header.value = _html(f"{row.title} · done")
            self.prompt.value = _html(
                f"{right} of {len(self.questions)} right at the first try.\n"
                f"Mastery of this topic: {row.mastered} of {row.questions} questions ({row.mastery:.0%}) "
                "answered right last time. distlab.quiz.summary() shows every topic."
            )
            self._enable(check=False, more=False)

    def _enable(self, *, check: bool, more: bool = True) -> None:
        self.check_button.disabled = not check
        self.reveal_button.disabled = not check
        self.hint_button.disabled = not check
        self.next_button.disabled = not more
        self.next_button.description = "Next" if self.index + 1 < len(self.questions) else "Finish"

    # -- answering -----------------------------------------------------------------------------------

    def _check(self) -> None:
        if self.attempt is None or self.view is None:
            return
        try:
            result = self.attempt.check(self.view.read())
        except Exception as error:  # noqa: BLE001 - live grading talks to the lab; show why it failed
            self.feedback.value = _html(f"Could not check this against the lab: {error}")
            return
        self.feedback.value = _verdict(result)
        if not result.counted:
            return
        self._record(result.correct)
        self.first_tries.setdefault(self.attempt.id, result.correct)
        if result.correct:
            self._close_question()
        self._update_score()

    def _show_hint(self) -> None:
        if self.attempt is not None:
            self.hint.value = _html(f"Hint: {self.attempt.hint}")

    def _reveal(self) -> None:
        if self.attempt is None:
            return
        try:
            answer = self.attempt.answer_text()
        except Exception as error:  # noqa: BLE001 - as in _check
            self.feedback.value = _html(f"Could not get the answer from the lab: {error}")
            return
        self.feedback.value = _html(f"The answer: {answer}")
        if self.attempt.id not in self.first_tries:
            self.first_tries[self.attempt.id] = False
            self._record(False)
        self._close_question()
        self._update_score()

    def _record(self, correct: bool) -> None:
        if self.attempt is None:
            return
        try:
            self.progress.record(self.attempt.id, correct)
        except OSError as error:
            # The verdict stands; only the saving failed, so say so beside it rather than lose both.
            self.feedback.value += _html(f"\n(Progress not saved: {error}. Check {self.progress.path}.)")

    def _close_question(self) -> None:
        if self.attempt is None or self.view is None:
            return
        self.view.disable()
        self.check_button.disabled = True
        self.reveal_button.disabled = True
        try:
            self.explanation.value = _html(self.attempt.explain())
        except Exception:  # noqa: BLE001 - the explanation is a bonus; never fail the answer over it
            self.explanation.value = _html(self.attempt.question.explanation)

    def _update_score(self) -> None:
        answered = len(self.first_tries)
        right = sum(self.first_tries.values())
        self.score.value = f"Score: {right} / {answered} right at the first try" if answered else ""

    # -- for scripts and tests -----------------------------------------------------------------------

    def submit(self, answer: object) -> None:
        """Put ``answer`` into the input widgets and press Check, as a learner would."""
        if self.view is None:
            raise ValueError("there is no open question: press Next, or show a new quiz")
        self.view.set(answer)
        self.check_button.click()


def _verdict(result: CheckResult) -> str:
    mark = "✔ " if result.correct else ("✘ " if result.counted else "")
    return _html(mark + result.feedback)
