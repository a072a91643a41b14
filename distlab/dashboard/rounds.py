"""The training round as a table, built from a watched run's telemetry: who did what, step by step.

    from distlab.dashboard import rounds
    table = rounds.round_table(lab.telemetry.records(), lab.telemetry.meta())
    table                          # step, epoch, node, action, local state, global state
    table.tracker(after=(5, 10))   # global and local weights at the start, after steps 5 and 10, at the end
    table.facts()                  # what must hold of every data-parallel round, as booleans and counts
    table.quiz()                   # questions graded against this table

The rows come from the records ``distlab.watch`` makes (one per rank per step: loss, timed all-reduces,
per-layer norms and exact checksums when ``stats_every=1, checksum_every=1``) and from what the loop
gives ``distlab.log``. These names are read when logged (all optional):

    samples_from, samples_to   the first and last sample id of the rank's batch
    own_grad_norm              the norm of the rank's own gradient, before the exchange
    w0, w1, ...                the first few weights after the update (``start_w0``, ... before step 0)

In data parallelism the global model is stored nowhere else: it is the model every replica holds.
Its state is shown where the ranks agree (equal checksums); where they do not, the table says that
no single global model exists.
"""

from __future__ import annotations

import html
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..quiz.model import Question
from ..records import StepRecord, WatchMeta
from .round_questions import table_questions
from .round_states import (
    ALL,
    RoundRow,
    Snapshot,
    Tracker,
    agreed,
    checksum_text,
    norm_total,
    values_text,
    weight_values,
)

__all__ = [
    "RoundRow",
    "RoundTable",
    "Snapshot",
    "Tracker",
    "checksum_text",
    "round_table",
    "values_text",
]


@dataclass
class RoundTable:
    """Every step of a watched run as rows, and the weights' states along the way (see the module)."""

    ranks: list[int]
    steps: list[int]
    rows: list[RoundRow]
    start_checksums: dict[int, int | None]
    start_values: dict[int, tuple[float, ...] | None]
    by_step: dict[int, dict[int, StepRecord]] = field(repr=False)

    # ------------------------------------------------------------------ states

    def local_checksum(self, step: int, rank: int) -> int | None:
        return self.by_step[step][rank].get("checksum")

    def global_checksum(self, step: int | None) -> int | None:
        """The checksum of the global weights after ``step``'s update (None: before the first)."""
        if step is None:
            return agreed([self.start_checksums.get(r) for r in self.ranks])
        return agreed([self.local_checksum(step, r) for r in self.ranks])

    def local_values(self, step: int | None, rank: int) -> tuple[float, ...] | None:
        if step is None:
            return self.start_values.get(rank)
        return weight_values(self.by_step[step][rank].get("metrics") or {}, "w")

    def snapshot(self, step: int | None, when: str | None = None) -> Snapshot:
        """The global and local weights after ``step`` (None: at the start)."""
        local_sums = {
            r: (self.start_checksums.get(r) if step is None else self.local_checksum(step, r)) for r in self.ranks
        }
        local_values = {r: self.local_values(step, r) for r in self.ranks}
        common = agreed(list(local_sums.values()))
        return Snapshot(
            when=when or ("start" if step is None else f"after step {step}"),
            step=step,
            global_checksum=common,
            global_values=agreed(list(local_values.values())) if common is not None else None,
            local_checksums=local_sums,
            local_values=local_values,
        )

    def tracker(self, after: Sequence[int] = (5, 10)) -> Tracker:
        """Snapshots at the start, after each step in ``after`` that the run has, and at the end."""
        points: list[Snapshot] = [self.snapshot(None)]
        for step in after:
            if step in self.by_step and step != self.steps[-1]:
                points.append(self.snapshot(step))
        if self.steps:
            points.append(self.snapshot(self.steps[-1], f"end (after step {self.steps[-1]})"))
        return Tracker(self.ranks, points)

    # ------------------------------------------------------------------ checks

    def facts(self) -> dict[str, Any]:
        """What every synchronous data-parallel round must show, as deterministic values."""
        per_step = {s: sum(1 for row in self.rows if row.step == s) for s in self.steps}
        updates = [row for row in self.rows if row.kind == "update"]
        epochs = sorted({row.epoch for row in self.rows if row.epoch is not None})
        return {
            "steps": len(self.steps),
            "epochs": epochs,
            "rows per step": sorted(set(per_step.values())),
            "every rank's local weights equal the global ones after each update": bool(updates)
            and all(self.global_checksum(row.step) is not None for row in updates),
            "the global weights change at every step": all(
                self.global_checksum(a) != self.global_checksum(b) for a, b in itertools.pairwise([None, *self.steps])
            ),
            "the last row is the exit": bool(self.rows) and self.rows[-1].kind == "exit",
            "no sample is on two ranks in the same step": all(self._disjoint(s) for s in self.steps),
        }

    def _disjoint(self, step: int) -> bool:
        """The ranks' logged sample ranges at ``step`` do not overlap (True when none were logged)."""
        spans = []
        for rec in self.by_step[step].values():
            m = rec.get("metrics") or {}
            if "samples_from" not in m or "samples_to" not in m:
                return True
            spans.append((m["samples_from"], m["samples_to"]))
        spans.sort()
        return all(a[1] < b[0] for a, b in itertools.pairwise(spans))

    # ------------------------------------------------------------------ showing

    def _cells(self) -> list[tuple[str, str, str, str, str, str]]:
        return [
            (
                "" if r.step is None else str(r.step),
                "" if r.epoch is None else str(r.epoch),
                r.node,
                r.action,
                r.local,
                r.global_state,
            )
            for r in self.rows
        ]

    def __str__(self) -> str:
        head = ("step", "epoch", "node", "action", "local state", "global state")
        cells = [head, *self._cells()]
        widths = [max(len(c[i]) for c in cells) for i in range(5)]
        return "\n".join(
            "  ".join(c[i].ljust(widths[i]) if i > 1 else c[i].rjust(widths[i]) for i in range(5)) + "  " + c[5]
            for c in cells
        )

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("step", "epoch", "node", "action", "local state", "global state"))
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in cells) + "</tr>"
            for cells in self._cells()
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    # ------------------------------------------------------------------ questions

    def questions(self, seed: int | None = None) -> list[Question]:
        """Questions whose answers are read from this table (``round_questions.table_questions``)."""
        return table_questions(self, random.Random(seed))

    def quiz(self, seed: int | None = None) -> Any:
        """A quiz widget on this table: each answer is graded against what your ranks recorded."""
        from ..quiz.progress import Progress
        from ..quiz.widget import QuizWidget

        class _NotSaved(Progress):
            # Questions about one run are not the bank's: answering them leaves the saved progress alone.
            def record(self, question_id: str, correct: bool) -> Any:
                return None

        return QuizWidget(self.questions(seed), topic="training-round", seed=seed, progress=_NotSaved())


# ---------------------------------------------------------------------------------------- building


def round_table(records: Sequence[StepRecord], meta: Mapping[int, WatchMeta]) -> RoundTable:
    """The table of a watched run: every step every rank finished, then the exit.

    Raises ValueError, naming the fix, when the records cannot make one (no steps, or steps
    recorded without checksums).
    """
    by_step: dict[int, dict[int, StepRecord]] = {}
    for rec in records:
        by_step.setdefault(rec["step"], {})[rec["rank"]] = rec
    ranks = sorted(meta) or sorted({rec["rank"] for rec in records})
    steps = sorted(s for s, recs in by_step.items() if all(r in recs for r in ranks))
    if not steps:
        raise ValueError("no step was recorded on every rank: train under distlab.watch(model, ...) in a %%ddp cell")
    if any(by_step[s][r].get("checksum") is None for s in steps for r in ranks):
        raise ValueError(
            "some steps have no checksum: watch with distlab.watch(model, stats_every=1, checksum_every=1)"
        )
    first = {r: by_step[steps[0]][r].get("metrics") or {} for r in ranks}
    table = RoundTable(
        ranks=ranks,
        steps=steps,
        rows=[],
        start_checksums={r: _start_checksum(meta.get(r)) for r in ranks},
        start_values={r: weight_values(first[r], "start_w") for r in ranks},
        by_step={s: by_step[s] for s in steps},
    )
    world = len(ranks)
    previous: int | None = None
    for step in steps:
        recs = [by_step[step][r] for r in ranks]
        epoch = agreed([rec.get("epoch") for rec in recs])
        before = table.global_checksum(previous)  # None: the start
        rows = table.rows
        for rec in recs:
            m = rec.get("metrics") or {}
            where = (
                f"samples {int(m['samples_from'])}..{int(m['samples_to'])}"
                if "samples_from" in m and "samples_to" in m
                else "its own batch"
            )
            loss = rec.get("loss")
            local = "loss not logged" if loss is None else f"loss {loss:.4f}"
            if "own_grad_norm" in m:
                local += f", own gradient norm {m['own_grad_norm']:.4f}"
            rows.append(
                RoundRow(
                    step,
                    epoch,
                    f"rank {rec['rank']}",
                    f"forward/backward on {where}",
                    local,
                    f"weights {checksum_text(before)} (as the last update left them)"
                    if previous is not None
                    else f"weights {checksum_text(before)} (the start)",
                    "compute",
                )
            )
        buckets = [rec.get("allreduce") or [] for rec in recs]
        if all(buckets):
            count = agreed([len(b) for b in buckets])
            size = agreed([sum(x["bytes"] for x in b) for b in buckets])
            what = (
                f"{count} tensor{'s' if count != 1 else ''}, {size:,} bytes from each rank"
                if count is not None and size is not None
                else "sizes differ across ranks"
            )
            rows.append(
                RoundRow(
                    step,
                    epoch,
                    ALL,
                    f"all-reduce gradients ({what})",
                    f"each rank's gradient := the sum over the {world} ranks",
                    "unchanged: nothing is updated yet",
                    "share",
                )
            )
        else:
            rows.append(
                RoundRow(
                    step, epoch, ALL, "no gradient exchange", "each rank keeps its own gradient", "unchanged", "share"
                )
            )
        norms = [norm_total(rec.get("grad_norm")) for rec in recs]
        mean = agreed(norms)
        if mean is not None:
            rows.append(
                RoundRow(
                    step,
                    epoch,
                    ALL,
                    f"aggregate: divide the sum by {world}",
                    f"gradient norm {mean:.4f}, the same on every rank",
                    f"averaged gradient, norm {mean:.4f}",
                    "aggregate",
                )
            )
        else:
            shown = ", ".join("?" if n is None else f"{n:.4f}" for n in norms)
            rows.append(
                RoundRow(
                    step, epoch, ALL, "aggregate", f"gradient norms differ: {shown}", "no common gradient", "aggregate"
                )
            )
        after = table.global_checksum(step)
        weight_norm = agreed([norm_total(rec.get("weight_norm")) for rec in recs])
        for rec in recs:
            mine = rec.get("checksum")
            same = "= global" if after is not None else "differs from another rank"
            values = values_text(weight_values(rec.get("metrics") or {}, "w"))
            rows.append(
                RoundRow(
                    step,
                    epoch,
                    f"rank {rec['rank']}",
                    "update: weights -= lr x averaged gradient",
                    f"weights {checksum_text(mine)} {values} ({same})".replace("  ", " "),
                    f"weights {checksum_text(after)}"
                    + (f", norm {weight_norm:.4f}" if weight_norm is not None else ""),
                    "update",
                )
            )
        previous = step
    last = steps[-1]
    final = table.global_checksum(last)
    epochs = sorted({row.epoch for row in table.rows if row.epoch is not None})
    done = f" after epoch {epochs[-1]}" if epochs else ""
    table.rows.append(
        RoundRow(
            None,
            epochs[-1] if epochs else None,
            ALL,
            f"exit: the loop ends{done} ({len(steps)} steps); the watch closes",
            "; ".join(f"rank {r} {checksum_text(table.local_checksum(last, r))}" for r in ranks),
            f"final weights {checksum_text(final)}",
            "exit",
        )
    )
    return table


def _start_checksum(meta: WatchMeta | None) -> int | None:
    sums = meta.get("initial_checksums") if meta else None
    return int(sum(sums.values())) if sums else None
