"""Numeric questions: numbers drawn per attempt, the answer computed by a :mod:`distlab.theory` function."""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .. import theory
from .model import Attempt, CheckResult, LabLike, Question, as_sentence, unreadable_answer
from .params import ParamSpec, Value, draw_params, format_quantity, show_params

__all__ = ["Mistake", "NumericQuestion", "Tolerance", "read_number", "theory_function"]


def theory_function(name: str) -> Callable[..., float]:
    """The public :mod:`distlab.theory` function called ``name`` (one that computes a number); a bank names
    functions, never code."""
    function = getattr(theory, name, None) if name in theory.__all__ else None
    if not inspect.isfunction(function):
        raise ValueError(f"{name!r} is not a function of distlab.theory")
    return function


@dataclass(frozen=True)
class Tolerance:
    """How close counts as right: within ``absolute`` (in the question's unit) or ``relative`` of the answer."""

    relative: float = 0.0
    absolute: float = 0.0

    def accepts(self, given: float, expected: float) -> bool:
        # The 1e-9 relative floor keeps exact answers exact despite float rounding in unit conversion.
        return abs(given - expected) <= max(self.absolute, self.relative * abs(expected), 1e-9 * abs(expected))


@dataclass(frozen=True)
class Mistake:
    """A typical wrong answer: the same question computed with ``overrides`` (display units) or by
    another theory function; a learner whose answer matches it gets ``feedback``."""

    feedback: str
    overrides: tuple[tuple[str, int | float | str], ...] = ()
    theory: str | None = None


def read_number(answer: object, unit: str) -> float:
    """A learner's answer in ``unit``: a number, or text such as "24", "24 ms" or "0.024 s"."""
    if isinstance(answer, bool):
        raise ValueError("give a number")
    if isinstance(answer, (int, float)):
        if not math.isfinite(answer):
            raise ValueError("give a finite number")
        return float(answer)
    if isinstance(answer, str):
        return theory.from_base_units(theory.parse_quantity(answer.replace(",", ""), unit), unit)
    raise ValueError(f"give a number{' in ' + unit if unit else ''}, e.g. 24")


def _scale_hint(given: float, expected: float) -> str:
    """A nudge when the answer is off by a power of 1000 (a unit slip) or simply too high or too low."""
    if given and expected and (given > 0) == (expected > 0):
        exponent = math.log10(abs(given / expected)) / 3
        if abs(exponent) >= 0.99 and abs(exponent - round(exponent)) < 0.01:
            return "Your number is off by a factor of 1000 or more: check the units."
    return "Too high." if given > expected else "Too low."


@dataclass(frozen=True, kw_only=True)
class NumericQuestion(Question):
    """Numbers drawn per attempt; the answer is ``theory(**params)`` expressed in ``unit``."""

    theory: str
    params: tuple[ParamSpec, ...]
    unit: str
    tolerance: Tolerance
    mistakes: tuple[Mistake, ...] = ()

    @property
    def parameterised(self) -> bool:
        return True

    def theory_arguments(self, params: Mapping[str, Value]) -> dict[str, object]:
        """The drawn ``params`` converted to the base units that :mod:`distlab.theory` takes."""
        return {spec.name: spec.to_theory(params[spec.name]) for spec in self.params}

    def compute(self, params: Mapping[str, Value], function: str | None = None) -> float:
        """The answer for ``params``, in this question's unit, from theory (``function`` defaults to ``theory``)."""
        called = theory_function(function or self.theory)
        arguments = self.theory_arguments(params)
        if function:
            # Another function (a typical mistake) takes the arguments it has names for.
            accepted = inspect.signature(called).parameters
            arguments = {name: value for name, value in arguments.items() if name in accepted}
        return theory.from_base_units(called(**arguments), self.unit)

    def _draw(self, rng: random.Random, lab: LabLike | None, params: dict[str, Value]) -> Attempt:
        drawn = draw_params(self.id, self.params, rng, params)
        fields = show_params(self.params, drawn)
        return Attempt(
            question=self,
            prompt=self.prompt.format_map(fields),
            hint=self.hint.format_map(fields),
            params=drawn,
            unit=self.unit,
        )

    def _answer(self, attempt: Attempt) -> float:
        return self.compute(attempt.params)

    def _answer_text(self, attempt: Attempt) -> str:
        return format_quantity(self._answer(attempt), self.unit)

    def _explain(self, attempt: Attempt) -> str:
        fields = show_params(self.params, attempt.params)
        return self.explanation.format_map({**fields, "answer": self._answer_text(attempt)})

    def _grade(self, attempt: Attempt, answer: object) -> CheckResult:
        try:
            given = read_number(answer, self.unit)
        except ValueError as error:
            return unreadable_answer(as_sentence(str(error)))
        expected = self._answer(attempt)
        if self.tolerance.accepts(given, expected):
            return CheckResult(True, f"Right: {self._answer_text(attempt)}.")
        for mistake in self.mistakes:
            slipped = self.compute({**attempt.params, **dict(mistake.overrides)}, mistake.theory)
            if self.tolerance.accepts(given, slipped) and not self.tolerance.accepts(slipped, expected):
                return CheckResult(False, f"Not quite. {mistake.feedback}")
        return CheckResult(False, f"Not quite. {_scale_hint(given, expected)}")
