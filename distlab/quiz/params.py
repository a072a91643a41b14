"""Parameters a question draws afresh for every attempt, and how they read in a prompt."""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .. import theory

__all__ = [
    "ParamSpec",
    "Value",
    "draw_params",
    "format_number",
    "format_quantity",
    "show_params",
    "template_fields",
]

#: A drawn value: a number in the unit the prompt shows, a word (e.g. an optimizer), or a list of numbers.
Value = int | float | str | list[int | float]


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter is drawn: a fixed ``value``, one of ``choices``, or ``low``..``high`` by ``step``.

    Numbers are drawn in ``unit`` (what the prompt shows, e.g. MB) and handed to :mod:`distlab.theory` in
    base units (bytes). ``length`` draws a list of that many numbers (e.g. one time per worker).
    """

    name: str
    unit: str = ""
    value: int | float | str | None = None
    choices: tuple[int | float | str, ...] = ()
    low: int | float | None = None
    high: int | float | None = None
    step: int | float | None = None
    length: int | None = None
    labels: tuple[tuple[str, str], ...] = ()

    def draw(self, rng: random.Random) -> Value:
        if self.length is None:
            return self._draw_one(rng)
        return [self._number(self._draw_one(rng)) for _ in range(self.length)]

    def _draw_one(self, rng: random.Random) -> int | float | str:
        if self.value is not None:
            return self.value
        if self.choices:
            return rng.choice(self.choices)
        if self.low is None or self.high is None or self.step is None:
            raise ValueError(f"parameter {self.name!r} needs a value, choices, or min, max and step")
        steps = round((self.high - self.low) / self.step)
        drawn = self.low + rng.randint(0, steps) * self.step
        # Whole-number ranges stay ints: counts such as workers must reach theory as int.
        if all(isinstance(x, int) for x in (self.low, self.step)):
            return int(drawn)
        return round(drawn, 12)

    def _number(self, value: object) -> int | float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"parameter {self.name!r} is a list of numbers, got {value!r}")
        return value

    def to_theory(self, value: Value) -> object:
        """``value`` as :mod:`distlab.theory` takes it: numbers in base units, words unchanged."""
        if isinstance(value, list):
            return [self._to_base(v) for v in value]
        return self._to_base(value)

    def _to_base(self, value: object) -> object:
        return value if isinstance(value, str) else theory.to_base_units(self._number(value), self.unit)

    def show(self, value: Value) -> str | list[str]:
        """``value`` as the prompt shows it: "400 MB", "mixed precision", or a list of those."""
        if isinstance(value, list):
            return [format_quantity(v, self.unit) for v in value]
        if isinstance(value, str):
            return dict(self.labels).get(value, value)
        return format_quantity(value, self.unit)


def draw_params(
    question_id: str, specs: Sequence[ParamSpec], rng: random.Random, fixed: Mapping[str, Value]
) -> dict[str, Value]:
    """One value per spec, drawn with ``rng`` unless ``fixed`` gives it (in the units the prompt shows)."""
    known = {spec.name for spec in specs}
    unknown = sorted(set(fixed) - known)
    if unknown:
        draws = ", ".join(sorted(known)) or "nothing"
        raise ValueError(f"question {question_id!r} has no parameter {unknown[0]!r}; it draws {draws}")
    return {spec.name: fixed[spec.name] if spec.name in fixed else spec.draw(rng) for spec in specs}


def show_params(specs: Sequence[ParamSpec], values: Mapping[str, Value]) -> dict[str, object]:
    """The values as a prompt shows them, for ``str.format_map``."""
    return {spec.name: spec.show(values[spec.name]) for spec in specs}


def format_number(value: float) -> str:
    """A number as a person writes it: 256, 24.02, 0.1429, 1,281,167."""
    if abs(value) >= 1e4:
        return f"{round(value):,}"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.4g}"


def format_quantity(value: float, unit: str) -> str:
    """``value`` followed by ``unit``: "400 MB", "25%", "3x", or just the number."""
    number = format_number(value)
    if not unit:
        return number
    return f"{number}{unit}" if unit in ("%", "x") else f"{number} {unit}"


def template_fields(text: str) -> set[str]:
    """The names a ``str.format`` template uses: ``{size_bytes}`` and ``{times_s[0]}`` give size_bytes, times_s."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(text):
        if field is not None:
            names.add(field.split("[", 1)[0].split(".", 1)[0])
    return names
