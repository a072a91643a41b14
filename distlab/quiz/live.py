"""Live questions: graded against the learner's running lab, by running the question's code on every rank.

The code is a short cell, as a learner would write it in ``%%ddp``; its last line is the expression whose
value on one rank is the answer. It runs inside a function, so it leaves no names behind on the ranks,
and it must not touch the global RNG (use a ``torch.Generator``) for the same reason.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field

from .model import Attempt, CheckResult, LabLike, Option, Question, as_sentence, unreadable_answer
from .numeric import Tolerance, read_number
from .params import ParamSpec, Value, draw_params, format_quantity, show_params

__all__ = ["LIVE_TIMEOUT_S", "LiveQuestion", "wrap_cell"]

#: How long a live question waits for the lab: enough for a few small collectives on a busy laptop.
LIVE_TIMEOUT_S = 60.0

_FUNCTION = "_distlab_quiz_cell"


def wrap_cell(code: str, params: Mapping[str, Value]) -> str:
    """``code`` as a function of ``params`` that returns its last expression, called at once.

    The function removes itself from the rank's namespace as it is called (``globals().pop``), so the
    learner's namespace is left as it was. Parameters arrive as defaults written with ``repr``: drawn
    numbers and words only, never text a user typed.
    """
    tree = ast.parse(code)
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr) or last.col_offset != 0:
        raise ValueError("the code must end with an expression on a line of its own: the value that is checked")
    lines = code.splitlines()
    body = "\n".join(lines[: last.lineno - 1]).strip("\n")
    expression = ast.get_source_segment(code, last)
    arguments = ", ".join(f"{name}={value!r}" for name, value in params.items())
    return (
        f"def {_FUNCTION}({arguments}):\n"
        + (textwrap.indent(body, "    ") + "\n" if body.strip() else "")
        + f"    return ({expression})\n"
        + f"globals().pop({_FUNCTION!r})()\n"
    )


def _numbers(value: object) -> list[float] | None:
    """A lab result or an answer as a flat list of numbers, or None if it is not numbers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, (list, tuple)):
        flat: list[float] = []
        for item in value:
            inner = _numbers(item)
            if inner is None:
                return None
            flat.extend(inner)
        return flat
    return None


@dataclass(frozen=True, kw_only=True)
class LiveQuestion(Question):
    """Run ``code`` on every rank and grade the answer against its value on ``rank``.

    ``response="numeric"``: the learner types a number (or numbers, "3, 3"), compared within ``tolerance``.
    ``response="choice"``: the learner picks an option; the right one is the option whose ``value`` the
    lab returned.
    """

    code: str
    rank: int | str  # a rank, or "last"
    response: str
    min_world_size: int = 2
    params: tuple[ParamSpec, ...] = ()
    unit: str = ""
    tolerance: Tolerance = field(default_factory=Tolerance)
    options: tuple[Option, ...] = ()

    @property
    def parameterised(self) -> bool:
        return bool(self.params)

    @property
    def needs_lab(self) -> bool:
        return True

    def program(self, params: Mapping[str, Value]) -> str:
        """The code sent to the ranks for these parameters."""
        return wrap_cell(self.code, {spec.name: params[spec.name] for spec in self.params})

    def _draw(self, rng: random.Random, lab: LabLike | None, params: dict[str, Value]) -> Attempt:
        if lab is None:
            n = self.min_world_size
            raise ValueError(
                f"question {self.id!r} is graded on your ranks, so this question needs a running lab: "
                f"run %dist start -n {n} first (or pass lab=distlab.start(ranks={n}))"
            )
        size = lab.world_size
        if size < self.min_world_size:
            raise ValueError(
                f"question {self.id!r} needs at least {self.min_world_size} ranks and the lab has {size}: "
                f"run %dist stop, then %dist start -n {self.min_world_size}"
            )
        rank = size - 1 if self.rank == "last" else int(self.rank)
        drawn = draw_params(self.id, self.params, rng, params)
        fields = {**show_params(self.params, drawn), "world_size": size, "rank": rank}
        shown = list(self.options)
        rng.shuffle(shown)
        return Attempt(
            question=self,
            prompt=self.prompt.format_map(fields),
            hint=self.hint.format_map(fields),
            params=drawn,
            choices=tuple(shown),
            unit=self.unit,
            code=self.code,
            rank=rank,
            lab=lab,
        )

    def observed(self, attempt: Attempt) -> object:
        """The value of the code's last line on the attempt's rank, run once per attempt."""
        if "observed" not in attempt.cache:
            if attempt.lab is None or attempt.rank is None:
                raise ValueError(f"attempt of {self.id!r} has no lab: draw it with lab=...")
            # record=False: a quiz's probe is not part of the learner's program (lab.export leaves it out).
            results = attempt.lab.run(self.program(attempt.params), timeout=LIVE_TIMEOUT_S, record=False)
            attempt.cache["observed"] = results[attempt.rank]
        return attempt.cache["observed"]

    def _option_for(self, attempt: Attempt) -> Option:
        value = self.observed(attempt)
        for option in self.options:
            if option.value == value and type(option.value) is type(value):
                return option
        raise RuntimeError(f"question {self.id!r}: the lab returned {value!r}, which no option stands for")

    def _answer(self, attempt: Attempt) -> object:
        if self.response == "choice":
            return self._option_for(attempt).id
        return self.observed(attempt)

    def _answer_text(self, attempt: Attempt) -> str:
        if self.response == "choice":
            return self._option_for(attempt).text
        numbers = _numbers(self.observed(attempt)) or []
        return ", ".join(format_quantity(n, self.unit) for n in numbers)

    def _explain(self, attempt: Attempt) -> str:
        size = attempt.lab.world_size if attempt.lab else ""
        fields = {**show_params(self.params, attempt.params), "world_size": size, "rank": attempt.rank}
        return self.explanation.format_map({**fields, "answer": self._answer_text(attempt)})

    def _grade(self, attempt: Attempt, answer: object) -> CheckResult:
        if self.response == "choice":
            ids = [option.id for option in self.options]
            if not isinstance(answer, str) or answer not in ids:
                return unreadable_answer(f"Pick the option you think is right (ids: {', '.join(ids)}).")
            picked = next(option for option in self.options if option.id == answer)
            correct = picked.id == self._option_for(attempt).id
            return CheckResult(correct, ("Right. " if correct else "Not quite. ") + picked.feedback)

        try:
            given = self._read(answer)
        except ValueError as error:
            return unreadable_answer(as_sentence(str(error)))
        expected = _numbers(self.observed(attempt))
        if expected is None:
            raise RuntimeError(f"question {self.id!r}: the lab returned {self.observed(attempt)!r}, not numbers")
        where = f"rank {attempt.rank}"
        if len(given) != len(expected):
            return CheckResult(
                False, f"Not quite: the value on {where} has {len(expected)} number(s); you gave {len(given)}."
            )
        if all(self.tolerance.accepts(g, e) for g, e in zip(given, expected)):
            return CheckResult(True, f"Right: {where} holds {self._answer_text(attempt)}.")
        return CheckResult(
            False, f"Not quite: that is not what {where} holds. Follow the data through the code, one rank at a time."
        )

    def _read(self, answer: object) -> list[float]:
        numbers = _numbers(answer)
        if numbers is not None:
            return numbers
        if not isinstance(answer, str):
            raise ValueError("give a number, or numbers separated by commas")
        # Commas separate numbers; with no unit to write, spaces may too ("3 3" or "[3.0, 3.0]").
        separators = r"[,\s]+" if not self.unit else r","
        parts = [part.strip() for part in re.split(separators, answer.strip().strip("[]()")) if part.strip()]
        if not parts:
            raise ValueError("give a number, or numbers separated by commas")
        return [read_number(part, self.unit) for part in parts]
