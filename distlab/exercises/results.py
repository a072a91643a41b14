"""What a check found: each case, on which rank it first went wrong and why, and the verdict."""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypedDict

__all__ = ["CaseDict", "CaseOutcome", "CaseResult", "ExerciseDict", "ExerciseResult", "Grade", "NotAttempted"]

#: A measured value as JSON keeps it (any other is given as its text).
Plain = int | float | str | bool | None


class CaseOutcome(TypedDict):
    """One rank's outcome of a case, as a grader returns it (``rank.exercise.passed`` / ``failed``)."""

    passed: bool
    message: str
    measured: dict[str, object]


class CaseDict(TypedDict):
    """A case of :meth:`ExerciseResult.to_dict`."""

    case: int  # counted from 1
    world_size: int
    name: str
    result: Literal["passed", "not run", "FAILED"]
    rank: int | None
    message: str
    measured: dict[str, Plain]


class ExerciseDict(TypedDict):
    """:meth:`ExerciseResult.to_dict`: a check in plain values."""

    passed: bool
    feedback: str
    seed: int
    cases: list[CaseDict]


class NotAttempted(TypedDict):
    """An exercise ``grade_all`` did not check: its names are not defined (``feedback`` says so)."""

    passed: bool  # False
    attempted: bool  # False
    feedback: str


#: An exercise's grade in ``grade_all``'s answer.
Grade = ExerciseDict | NotAttempted


@dataclass(frozen=True)
class CaseResult:
    """One case in one world: passed, failed (``rank``: the first rank that says so), or not run."""

    index: int
    world_size: int
    name: str
    passed: bool
    message: str = ""
    rank: int | None = None
    measured: Mapping[str, object] = field(default_factory=dict)  # rank 0's, or the failing rank's
    ran: bool = True

    @property
    def label(self) -> str:
        return f"case {self.index + 1} ({self.name}, {self.world_size} ranks)"

    @property
    def verdict(self) -> Literal["passed", "not run", "FAILED"]:
        return "passed" if self.passed else ("not run" if not self.ran else "FAILED")


@dataclass(frozen=True, repr=False)
class ExerciseResult:
    """A check of one exercise. ``passed`` only when every case passed; ``feedback`` says why not."""

    name: str
    passed: bool
    feedback: str
    cases: tuple[CaseResult, ...]
    seed: int

    @property
    def failures(self) -> list[CaseResult]:
        return [case for case in self.cases if case.ran and not case.passed]

    def to_dict(self) -> ExerciseDict:
        """Plain values (for JSON: what headless grading prints)."""
        return {
            "passed": self.passed,
            "feedback": self.feedback,
            "seed": self.seed,
            "cases": [
                {
                    "case": c.index + 1,
                    "world_size": c.world_size,
                    "name": c.name,
                    "result": c.verdict,
                    "rank": c.rank,
                    "message": c.message,
                    "measured": _plain(c.measured),
                }
                for c in self.cases
            ],
        }

    def __str__(self) -> str:
        head = f"{self.name}: {'passed' if self.passed else 'not yet'}: {self.feedback}"
        rows = [f"  {c.verdict:>7}  {c.label}" + (f": {c.message}" if c.message else "") for c in self.cases]
        return "\n".join([head, *rows])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colour = "#1a7f37" if self.passed else "#cf222e"
        rows = "".join(
            "<tr>"
            f"<td>{c.index + 1}</td><td>{c.world_size}</td><td>{html.escape(c.name)}</td>"
            f"<td style='color:{_colour(c)}'>{c.verdict}</td>"
            f"<td>{'' if c.rank is None else c.rank}</td>"
            f"<td style='text-align:left'>{html.escape(c.message)}</td>"
            f"<td style='text-align:left'>{html.escape(_measured_text(c.measured))}</td>"
            "</tr>"
            for c in self.cases
        )
        return (
            f"<div class='distlab-exercise-result'><p><b>{html.escape(self.name)}</b>: "
            f"<span style='color:{colour}'>{'passed' if self.passed else 'not yet'}</span>: "
            f"{html.escape(self.feedback)}</p>"
            "<table><thead><tr><th>case</th><th>ranks</th><th>what</th><th>result</th><th>rank</th>"
            f"<th>why</th><th>measured</th></tr></thead><tbody>{rows}</tbody></table></div>"
        )


def _colour(case: CaseResult) -> str:
    return "#1a7f37" if case.passed else ("#6e7781" if not case.ran else "#cf222e")


def _measured_text(measured: Mapping[str, object]) -> str:
    return ", ".join(f"{key} {_format(value)}" for key, value in measured.items())


def _format(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _plain(measured: Mapping[str, object]) -> dict[str, Plain]:
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in measured.items()}
