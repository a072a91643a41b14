"""A training round's states as data and text: the rows of its table, the weights at one point
(``Snapshot``), the status tracker, and how a checksum or a few weights are written.

Plain data and formatting, read by the table that builds them (``rounds``) and by the questions
asked about it (``round_questions``).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ..records import StepRecord

__all__ = [
    "ALL",
    "RoundRow",
    "RoundStates",
    "Snapshot",
    "Tracker",
    "agreed",
    "checksum_text",
    "norm_total",
    "values_text",
    "weight_values",
]

#: What the table calls the whole world in its node column.
ALL = "all ranks"


def checksum_text(value: int | None) -> str:
    """A checksum as a short tag (its low 32 bits in hex): '#1a2b3c4d'; None: no single value."""
    return "none: the ranks differ" if value is None else f"#{value & 0xFFFFFFFF:08x}"


@dataclass(frozen=True)
class RoundRow:
    """One line of the table: at ``step`` (None for the exit), ``node`` did ``action``."""

    step: int | None
    epoch: int | None
    node: str
    action: str
    local: str
    global_state: str
    kind: str  # compute, share, aggregate, update, exit


@dataclass(frozen=True)
class Snapshot:
    """The global weights and each rank's local weights at one point of the run."""

    when: str
    step: int | None  # the last update done (None: before the first)
    global_checksum: int | None  # None when the ranks differ
    global_values: tuple[float, ...] | None
    local_checksums: dict[int, int | None]
    local_values: dict[int, tuple[float, ...] | None]

    def locals_equal_global(self) -> bool:
        return self.global_checksum is not None and all(
            c == self.global_checksum for c in self.local_checksums.values()
        )


def weight_values(metrics: Mapping[str, float], prefix: str) -> tuple[float, ...] | None:
    """The first few weights logged as ``w0, w1, ...`` (``prefix`` "w", or "start_w" before step 0)."""
    found: list[float] = []
    while f"{prefix}{len(found)}" in metrics:
        found.append(float(metrics[f"{prefix}{len(found)}"]))
    return tuple(found) or None


def values_text(values: tuple[float, ...] | None) -> str:
    """A few weights as text: '[+0.1234, -0.5678, ...]'; None: ''."""
    return "" if values is None else "[" + ", ".join(f"{v:+.4f}" for v in values) + ", ...]"


def norm_total(values: Mapping[str, float] | None) -> float | None:
    """The whole model's norm from its per-layer norms (None when there are none)."""
    if not values:
        return None
    return float(sum(v * v for v in values.values()) ** 0.5)


_T = TypeVar("_T")


def agreed(values: Sequence[_T | None]) -> _T | None:
    """The value every rank holds, or None when they differ (or one is missing)."""
    first = values[0] if values else None
    return first if first is not None and all(v == first for v in values) else None


class RoundStates(Protocol):
    """What a round's questions read of its table (``rounds.RoundTable`` is one)."""

    ranks: list[int]
    steps: list[int]
    by_step: dict[int, dict[int, StepRecord]]

    def local_checksum(self, step: int, rank: int) -> int | None: ...

    def global_checksum(self, step: int | None) -> int | None: ...

    def local_values(self, step: int | None, rank: int) -> tuple[float, ...] | None: ...


@dataclass(frozen=True)
class Tracker:
    """The status tracker: global and local weights at a few points of the run."""

    ranks: list[int]
    points: list[Snapshot]

    def _cells(self) -> list[list[str]]:
        out = []
        for p in self.points:
            row = [p.when, f"{checksum_text(p.global_checksum)} {values_text(p.global_values)}".rstrip()]
            for r in self.ranks:
                same = " (= global)" if p.global_checksum is not None else ""
                row.append(f"{checksum_text(p.local_checksums[r])} {values_text(p.local_values[r])}{same}".rstrip())
            out.append(row)
        return out

    def _head(self) -> list[str]:
        return ["when", "global weights", *(f"rank {r}: local weights" for r in self.ranks)]

    def __str__(self) -> str:
        cells = [self._head(), *self._cells()]
        widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
        return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(c))).rstrip() for c in cells)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self._head())
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in self._cells()
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
