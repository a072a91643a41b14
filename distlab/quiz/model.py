"""Questions, attempts and grading. Grading is plain Python, so a test (or a script) can answer a question.

A :class:`Question` is what the bank holds. ``question.draw(seed)`` makes an :class:`Attempt`: the prompt
as a learner sees it, with options shuffled and numbers drawn. ``attempt.check(answer)`` grades it and
``attempt.answer()`` gives the right answer (computed, never stored).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .params import Value

__all__ = [
    "Attempt",
    "CheckResult",
    "ChoiceQuestion",
    "LabLike",
    "Option",
    "OrderingQuestion",
    "Question",
    "as_sentence",
    "unreadable_answer",
]


class LabLike(Protocol):
    """What a live question uses of :class:`distlab.Lab`."""

    @property
    def world_size(self) -> int: ...

    def run(
        self,
        code: str,
        ranks: str | int | Iterable[int] | None = None,
        timeout: float | None = None,
        record: bool = True,
    ) -> Mapping[int, object]: ...


@dataclass(frozen=True)
class CheckResult:
    """The verdict on one answer.

    ``counted`` is False when the answer could not be read (nothing picked, not a number): the learner
    is told how to answer, and it does not count as an attempt.
    """

    correct: bool
    feedback: str
    counted: bool = True


def unreadable_answer(feedback: str) -> CheckResult:
    return CheckResult(correct=False, feedback=feedback, counted=False)


def as_sentence(text: str) -> str:
    """An error message as feedback: capitalised, ending with a full stop."""
    text = text.strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith((".", "?", "!")) else ".")


@dataclass(frozen=True)
class Option:
    """A choice, or one step of an ordering question. ``value`` is what the lab returns when this option
    is true (live questions); ``feedback`` says why it is right or wrong."""

    id: str
    text: str
    feedback: str
    correct: bool = False
    value: object = None


@dataclass(eq=False)
class Attempt:
    """One showing of a question: the prompt filled in, options in the order shown, drawn parameters."""

    question: Question
    prompt: str
    hint: str
    params: Mapping[str, Value] = field(default_factory=dict)
    choices: tuple[Option, ...] = ()
    unit: str = ""
    code: str | None = None
    rank: int | None = None
    lab: LabLike | None = field(default=None, repr=False)
    # Filled by the question on first use: a live question's lab result is fetched once per attempt.
    cache: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def id(self) -> str:
        return self.question.id

    @property
    def kind(self) -> str:
        return self.question.kind

    def check(self, answer: object) -> CheckResult:
        """Grade ``answer``: an option id (single), option ids (multiple), ids in order (ordering), a number
        or text like "24 ms" (numeric), or what the live question asks for."""
        return self.question._grade(self, answer)

    def answer(self) -> object:
        """The right answer, in the form :meth:`check` takes."""
        return self.question._answer(self)

    def answer_text(self) -> str:
        """The right answer, as a sentence fragment a learner reads."""
        return self.question._answer_text(self)

    def explain(self) -> str:
        """The explanation, with this attempt's numbers filled in."""
        return self.question._explain(self)


@dataclass(frozen=True, kw_only=True)
class Question:
    """A question of the bank. Subclasses grade one kind each."""

    id: str
    topic: str
    kind: str
    difficulty: str
    prompt: str
    hint: str
    explanation: str
    source: str = field(default="", compare=False, repr=False)

    @property
    def parameterised(self) -> bool:
        """True when every attempt draws new numbers: check an attempt, not the question."""
        return False

    @property
    def needs_lab(self) -> bool:
        return False

    def draw(
        self, seed: int | None = None, *, lab: LabLike | None = None, params: Mapping[str, Value] | None = None
    ) -> Attempt:
        """A fresh attempt. ``params`` fixes drawn numbers (in the units the prompt shows) instead of drawing them."""
        return self._draw(random.Random(seed), lab, dict(params or {}))

    def check(self, answer: object, lab: LabLike | None = None) -> CheckResult:
        """Grade ``answer`` for a question that draws nothing; see :meth:`Attempt.check` for its forms."""
        if self.parameterised:
            raise ValueError(
                f"question {self.id!r} draws new numbers for every attempt: "
                "check an attempt instead, e.g. a = q.draw(seed=1); a.check(answer)"
            )
        return self.draw(lab=lab).check(answer)

    # What each kind implements.
    def _draw(self, rng: random.Random, lab: LabLike | None, params: dict[str, Value]) -> Attempt:
        raise NotImplementedError

    def _grade(self, attempt: Attempt, answer: object) -> CheckResult:
        raise NotImplementedError

    def _answer(self, attempt: Attempt) -> object:
        raise NotImplementedError

    def _answer_text(self, attempt: Attempt) -> str:
        raise NotImplementedError

    def _explain(self, attempt: Attempt) -> str:
        return self.explanation

    def _no_params(self, params: Mapping[str, Value]) -> None:
        if params:
            raise ValueError(f"question {self.id!r} draws no numbers; it takes no params (got {sorted(params)})")


def _option_ids(answer: object) -> list[str] | None:
    """``answer`` as a list of ids, or None if it is not one (a lone id counts as a list of one)."""
    if isinstance(answer, str):
        return [answer]
    if isinstance(answer, (Sequence, set, frozenset)):
        items = list(answer)
        return items if all(isinstance(item, str) for item in items) else None
    return None


@dataclass(frozen=True, kw_only=True)
class ChoiceQuestion(Question):
    """Single choice (one right option) or multiple choice (tick every right option)."""

    options: tuple[Option, ...]

    def _draw(self, rng: random.Random, lab: LabLike | None, params: dict[str, Value]) -> Attempt:
        self._no_params(params)
        shown = list(self.options)
        rng.shuffle(shown)
        return Attempt(question=self, prompt=self.prompt, hint=self.hint, choices=tuple(shown))

    def _by_id(self) -> dict[str, Option]:
        return {option.id: option for option in self.options}

    def _grade(self, attempt: Attempt, answer: object) -> CheckResult:
        options = self._by_id()
        picked = _option_ids(answer)
        if picked is None or not picked or any(item not in options for item in picked):
            what = "the option you think is right" if self.kind == "single" else "every option you think is right"
            return unreadable_answer(f"Pick {what} (ids: {', '.join(options)}).")
        if self.kind == "single":
            if len(picked) != 1:
                return unreadable_answer("Pick exactly one option.")
            option = options[picked[0]]
            return CheckResult(option.correct, ("Right. " if option.correct else "Not quite. ") + option.feedback)

        chosen = set(picked)
        right = {option.id for option in self.options if option.correct}
        if chosen == right:
            return CheckResult(True, "Right. " + " ".join(options[i].feedback for i in self._ordered(right)))
        lines = [f"'{options[i].text}': {options[i].feedback}" for i in self._ordered(chosen - right)]
        missed = len(right - chosen)
        if missed:
            # Say how many were missed, not which: the learner can try again.
            lines.append(f"{missed} right option{'s' if missed > 1 else ''} not ticked.")
        return CheckResult(False, "Not quite. " + " ".join(lines))

    def _ordered(self, ids: set[str]) -> list[str]:
        return [option.id for option in self.options if option.id in ids]

    def _answer(self, attempt: Attempt) -> str | tuple[str, ...]:
        right = [option.id for option in self.options if option.correct]
        return right[0] if self.kind == "single" else tuple(right)

    def _answer_text(self, attempt: Attempt) -> str:
        return "; ".join(option.text for option in self.options if option.correct)


@dataclass(frozen=True, kw_only=True)
class OrderingQuestion(Question):
    """Put the items in order. ``items`` holds them in the right order; attempts show them shuffled."""

    items: tuple[Option, ...]

    def _draw(self, rng: random.Random, lab: LabLike | None, params: dict[str, Value]) -> Attempt:
        self._no_params(params)
        shown = list(self.items)
        # Showing the items already in order would give the answer away.
        while shown == list(self.items):
            rng.shuffle(shown)
        return Attempt(question=self, prompt=self.prompt, hint=self.hint, choices=tuple(shown))

    def _grade(self, attempt: Attempt, answer: object) -> CheckResult:
        given = _option_ids(answer)
        ids = [item.id for item in self.items]
        if given is None or sorted(given) != sorted(ids):
            # Ids sorted by name: listed in their own order they would give the answer away.
            return unreadable_answer(f"Give all {len(ids)} items in order, each once (ids: {', '.join(sorted(ids))}).")
        if given == ids:
            return CheckResult(True, "Right: that is the order.")
        in_place = sum(g == i for g, i in zip(given, ids))
        first_wrong = next(position for position, (g, i) in enumerate(zip(given, ids)) if g != i)
        misplaced = self.items[ids.index(given[first_wrong])]
        return CheckResult(
            False,
            f"Not quite: {in_place} of {len(ids)} in the right place. "
            f"Step {first_wrong + 1}, '{misplaced.text}', is out of place: {misplaced.feedback}",
        )

    def _answer(self, attempt: Attempt) -> tuple[str, ...]:
        return tuple(item.id for item in self.items)

    def _answer_text(self, attempt: Attempt) -> str:
        return " -> ".join(item.text for item in self.items)
