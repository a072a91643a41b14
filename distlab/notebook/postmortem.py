"""A look inside a failed rank: its frames and their locals, as text and HTML (``lab.postmortem()``, ``%dist debug``).

A rank keeps the exception of a cell that failed, traceback and all, until its next cell starts
(``rank/postmortem.py``); asked, it describes the frames as plain data, which :class:`Postmortem`
formats here. :class:`LastCell` is what the lab remembers of its last cell (which ranks failed,
which died, whether the world was restarted after it): with it, a rank that keeps nothing is
told apart from one that never failed, and the lab knows which rank to look at first.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DistlabError, format_ranks

__all__ = [
    "MAX_FRAMES",
    "MAX_LOCALS",
    "LastCell",
    "Postmortem",
    "describe_value",
    "first_failed",
    "gone",
    "nothing_kept",
]

#: Frames a postmortem shows (the failing one, the cell, the user's own first, then library ones)
#: and locals per frame of the user's code.
MAX_FRAMES = 12
MAX_LOCALS = 30

_CAUSES_GONE = ("Stopped", "EngineError")


@dataclass(frozen=True)
class LastCell:
    """What the lab remembers of its last cell (or script, or graded case)."""

    #: The ranks it ran on.
    ran: tuple[int, ...]
    #: The ranks that failed, those that raised by themselves first, then those distlab stopped.
    failed: tuple[int, ...] = ()
    #: The ranks whose process died in it, or was killed to stop it.
    died: tuple[int, ...] = ()
    #: Recovery restarted the world after it: every rank's process is new.
    restarted: bool = False

    @classmethod
    def of(cls, ran: Sequence[int], outcome: Any, restarted: bool) -> LastCell:
        """From a cell's ``CellOutcome`` (``notebook/cell.py``)."""
        failures = outcome.failures
        died = sorted(set(outcome.killed) | {r for r, f in failures.items() if f.ename == "EngineError"})
        stopped = set(outcome.stopped) | {r for r, f in failures.items() if f.ename == "Stopped"}
        own = [r for r, f in sorted(failures.items()) if r not in stopped and f.ename not in _CAUSES_GONE]
        rest = [r for r in sorted(failures) if r not in own]
        return cls(tuple(ran), tuple(own + rest), tuple(died), restarted)


def first_failed(last: LastCell | None) -> int:
    """The rank to look at when none is named: the first that failed by itself in the last cell.

    Raises DistlabError (one line) when the last cell failed nowhere.
    """
    if last is None:
        raise DistlabError("no cell has run in this world yet: there is no failure to look into")
    if not last.failed:
        raise DistlabError(
            "the lab's last cell failed on no rank: there is no failure to look into "
            "(name a rank to look at one that failed earlier: lab.postmortem(1), %dist debug 1)"
        )
    alive = [r for r in last.failed if r not in last.died]
    return alive[0] if alive else last.failed[0]


def gone(rank: int, last: LastCell | None) -> str | None:
    """Why the rank cannot keep a failure of the last cell whatever it says (its process is new or dead), else None."""
    if last is None:
        return None
    if rank in last.died:
        restarted = "; the world was restarted since, so no rank keeps anything of that cell" if last.restarted else ""
        return (
            f"rank {rank} kept no failure: its process died in the last cell (killed, or it crashed), "
            f"and what it held went with it{restarted}"
        )
    if last.restarted:
        dead = f" (rank {format_ranks(last.died)} was killed)" if last.died else ""
        return (
            f"rank {rank} kept no failure: the world was restarted after the last cell failed{dead}, "
            "so every rank's process is new and holds nothing of it"
        )
    return None


def nothing_kept(rank: int, last: LastCell | None) -> str:
    """The line to show when the rank answered that it keeps no failure."""
    head = f"rank {rank} kept no failure: "
    if last is None:
        return head + "no cell has run since the world started"
    if rank in last.ran and rank not in last.failed:
        return head + "its last cell succeeded (a failure is kept only until the next cell starts)"
    if rank in last.failed:
        return head + "its last cell failed before its code started"
    return head + "no cell has failed on it since its last cell started"


class Postmortem:
    """One rank's kept failure: ``print(pm)`` for the text, ``pm.frames`` for the data, ``pm.to_dict()``.

    Frames run from the user's cell down to where it failed (most recent call last, as Python's
    tracebacks); a notebook shows the HTML form.
    """

    def __init__(self, rank: int, data: dict[str, Any]) -> None:
        self.rank = rank
        self.ename: str = data["ename"]
        self.evalue: str = data["evalue"]
        #: The file name the failed code ran under (``<rank 1 cell>``, a script's path).
        self.filename: str = data["filename"]
        #: What the failure interrupted or was raised from ("while handling RuntimeError: ..."), or "".
        self.context: str = data.get("context", "")
        #: Each frame: filename, where, lineno, function, line, library, locals, more_locals, skipped.
        self.frames: list[dict[str, Any]] = data["frames"]
        self._data = data

    @property
    def headline(self) -> str:
        return f"{self.ename}: {self.evalue}" if self.evalue else self.ename

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, **self._data}

    def __repr__(self) -> str:
        return f"<Postmortem of rank {self.rank}: {self.headline.splitlines()[0] if self.headline else ''}>"

    def __str__(self) -> str:
        lines = [f"rank {self.rank} failed: {self.headline}"]
        if self.context:
            lines.append(f"  ({self.context})")
        lines.append("frames, most recent call last (the rank keeps them until its next cell starts):")
        for i, frame in enumerate(self.frames):
            if frame["skipped"]:
                lines.append(f"  ... {_count(frame['skipped'], 'frame')} left out")
            tag = "[library] " if frame["library"] else ""
            last = "   <- failed here" if i == len(self.frames) - 1 else ""
            lines.append(f"  {tag}{frame['where']}, line {frame['lineno']}, in {frame['function']}{last}")
            if frame["line"]:
                lines.append(f"      {frame['line']}")
            for local in frame["locals"]:
                lines.append(f"        {local['name']} = {describe_value(local)}")
            if frame["more_locals"]:
                lines.append(f"        ... {_count(frame['more_locals'], 'more local')}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        esc = html.escape
        parts = [
            "<div class='distlab-postmortem'>",
            (
                f"<p><b>rank {self.rank} failed:</b> <code>{esc(self.headline)}</code><br>"
                + (f"<small>({esc(self.context)})</small><br>" if self.context else "")
                + "<small>frames, most recent call last (the rank keeps them until its next cell starts)</small></p>"
            ),
        ]
        for i, frame in enumerate(self.frames):
            if frame["skipped"]:
                parts.append(f"<p><small>... {_count(frame['skipped'], 'frame')} left out</small></p>")
            tag = "<small>[library]</small> " if frame["library"] else ""
            failed = " <b>&larr; failed here</b>" if i == len(self.frames) - 1 else ""
            parts.append(
                f"<details{' open' if not frame['library'] or failed else ''}><summary>{tag}"
                f"<code>{esc(frame['where'])}</code>, line {frame['lineno']}, in <code>{esc(frame['function'])}"
                f"</code>{failed}</summary>"
            )
            if frame["line"]:
                parts.append(f"<pre style='margin:0 0 0 2em'>{esc(frame['line'])}</pre>")
            if frame["locals"]:
                rows = "".join(
                    f"<tr><td><code>{esc(local['name'])}</code></td><td>{esc(describe_value(local))}</td></tr>"
                    for local in frame["locals"]
                )
                parts.append(f"<table style='margin-left:2em'>{rows}</table>")
            if frame["more_locals"]:
                parts.append(
                    f"<p style='margin-left:2em'><small>... {_count(frame['more_locals'], 'more local')}</small></p>"
                )
            parts.append("</details>")
        parts.append("</div>")
        return "".join(parts)


def describe_value(local: dict[str, Any]) -> str:
    """One summarised local in words: 'tensor (3, 4) float32 cpu: min 0, max 1, mean 0.5, norm 2'."""
    kind = local["kind"]
    if kind == "tensor":
        shape = _shape(local["shape"])
        name = "tensor" if local["type"] == "Tensor" else local["type"]
        text = f"{name} {shape} {local['dtype']} {local['device']}"
        if local.get("placements") is not None:
            text += (
                f", placements ({', '.join(local['placements'])}) on mesh {_shape(local['mesh'])}, "
                f"local shard {_shape(local['local_shape'])}"
            )
        if local["requires_grad"]:
            text += ", requires_grad"
        stats = ", ".join(f"{k} {_number(v)}" for k, v in local["stats"].items())
        bad = ", ".join(f"{local[k]} {k}" for k in ("nan", "inf") if local[k])
        if bad:
            stats = f"{bad}{'; of the finite: ' + stats if stats else ''}"
        if stats:
            text += f": {stats}"
        if local["note"]:
            text += f" ({local['note']})"
        return text
    if kind == "module":
        mode = "" if local["training"] else ", eval mode"
        return f"{local['type']} module, {local['parameters']:,} parameters{mode}"
    if kind == "container":
        items = f", each a {local['items']}" if local["items"] and local["length"] else ""
        return f"{local['type']} of {local['length']}{items}"
    if kind == "array":
        return f"{local['type']} {_shape(local['shape'])} {local['dtype']}"
    return str(local["repr"])


def _shape(dims: list[int]) -> str:
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"
