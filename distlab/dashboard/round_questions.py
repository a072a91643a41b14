"""Questions about one run's training round, each answer read from its table (``RoundTable.questions()``).

The table (``dashboard/rounds.py``) says what happened; these ask the learner to read it: the global
model's checksum after a step, a rank's first weights, whose weights differ, a batch's samples, a
rank's loss. The steps asked about are drawn, so each run gets its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ..quiz.model import Attempt, CheckResult, LabLike, Option, Question, unreadable_answer
from ..quiz.numeric import Tolerance, read_number
from .round_states import RoundStates, checksum_text, values_text

__all__ = ["TableQuestion", "table_questions"]


@dataclass(frozen=True, kw_only=True)
class TableQuestion(Question):
    """A question about one run's table: choose an option, or give numbers read from the table."""

    options: tuple[Option, ...] = ()
    expected: tuple[float, ...] = ()
    tolerance: Tolerance = field(default_factory=Tolerance)
    answer_text: str = ""

    def _draw(self, rng: random.Random, lab: LabLike | None, params: dict[str, Any]) -> Attempt:
        self._no_params(params)
        shown = list(self.options)
        rng.shuffle(shown)
        return Attempt(question=self, prompt=self.prompt, hint=self.hint, choices=tuple(shown))

    def _grade(self, attempt: Attempt, answer: Any) -> CheckResult:
        if self.options:
            ids = {o.id: o for o in self.options}
            if not isinstance(answer, str) or answer not in ids:
                return unreadable_answer(f"Pick the option you think is right (ids: {', '.join(ids)}).")
            picked = ids[answer]
            return CheckResult(picked.correct, ("Right. " if picked.correct else "Not quite. ") + picked.feedback)
        try:
            given = _numbers(answer)
        except ValueError as error:
            return unreadable_answer(str(error))
        if len(given) != len(self.expected):
            return CheckResult(
                False, f"Not quite: the table holds {len(self.expected)} number(s) here; you gave {len(given)}."
            )
        if all(self.tolerance.accepts(g, e) for g, e in zip(given, self.expected)):
            return CheckResult(True, f"Right: your table says {self.answer_text}.")
        return CheckResult(False, "Not quite: read that row of your table again.")

    def _answer(self, attempt: Attempt) -> Any:
        if self.options:
            return next(o.id for o in self.options if o.correct)
        return list(self.expected)

    def _answer_text(self, attempt: Attempt) -> str:
        return self.answer_text


def _numbers(answer: Any) -> list[float]:
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return [float(answer)]
    if isinstance(answer, (list, tuple)):
        return [read_number(a, "") for a in answer]
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError("Give a number, or numbers separated by commas.")
    parts = [p for p in answer.replace("[", " ").replace("]", " ").replace(",", " ").split() if p != "..."]
    return [read_number(p, "") for p in parts]


def _question(slug: str, prompt: str, hint: str, explanation: str, **kw: Any) -> TableQuestion:
    return TableQuestion(
        id=f"training-round/your-table-{slug}",
        topic="training-round",
        kind="single" if kw.get("options") else "numeric",
        difficulty="easy",
        prompt=prompt,
        hint=hint,
        explanation=explanation,
        **kw,
    )


def table_questions(table: RoundStates, rng: random.Random) -> list[Question]:
    """Questions about ``table``; each answer is read from it (the steps asked about are drawn)."""
    steps, ranks = table.steps, table.ranks
    out: list[Question] = []
    middle = [s for s in steps[1:-1] if table.global_checksum(s) is not None]
    if middle:
        step = 5 if 5 in middle else rng.choice(middle)
        right = table.global_checksum(step)
        others = [table.global_checksum(None), table.global_checksum(step - 1), table.global_checksum(step + 1)]
        right_text = f"That is the checksum every rank holds after the update of step {step}."
        seen, options = {right}, [Option("right", checksum_text(right), right_text, correct=True)]
        for i, value in enumerate(others):
            if value is not None and value not in seen:
                seen.add(value)
                when = ["at the start", f"after step {step - 1}", f"after step {step + 1}"][i]
                options.append(Option(f"wrong{i}", checksum_text(value), f"That is the global state {when}."))
        out.append(
            _question(
                "global-after",
                f"In your table, what is the global model's checksum after step {step}?",
                f"Find step {step}'s update rows: every rank's local checksum there is the global one.",
                "After each update every replica holds the same weights, so the global state is the checksum "
                "they share.",
                options=tuple(options),
            )
        )
    rank = ranks[-1]
    values = [s for s in steps if table.local_values(s, rank)]
    if values:
        step = 10 if 10 in values else rng.choice(values)
        expected = table.local_values(step, rank) or ()
        out.append(
            _question(
                "local-values",
                f"What are rank {rank}'s first {len(expected)} local weights after step {step}? "
                "(4 decimals, separated by commas)",
                "The update rows (and the status tracker) show them; they are the global ones too.",
                "Every rank applied the same averaged gradient to the same weights, so its local values are "
                "the global ones.",
                expected=tuple(expected),
                tolerance=Tolerance(absolute=6e-5),
                answer_text=values_text(tuple(expected)),
            )
        )
    picked = rng.choice(steps)
    differ = [r for r in ranks if table.local_checksum(picked, r) != table.global_checksum(picked)]
    options = [
        Option(
            "none", "none: every rank holds the global weights", "Equal checksums on every rank.", correct=not differ
        )
    ]
    for r in ranks:
        why = "differs." if r in differ else "is the global one."
        options.append(Option(f"rank{r}", f"rank {r}", f"rank {r}'s checksum {why}", correct=differ == [r]))
    options.append(
        Option(
            "all",
            "the ranks disagree: there is no single global model",
            "Replicas that differ leave no one model to call global.",
            correct=len(differ) > 1,
        )
    )
    out.append(
        _question(
            "who-differs",
            f"After the update of step {picked}, whose local weights differ from the global weights?",
            "Compare the local checksums of that step's update rows with the global state column.",
            "With averaged gradients and equal starting weights, no replica can differ.",
            options=tuple(options),
        )
    )
    with_samples = [s for s in steps if "samples_from" in (table.by_step[s][rank].get("metrics") or {})]
    if with_samples:
        step = rng.choice(with_samples)
        m = table.by_step[step][rank]["metrics"]
        expected = (float(m["samples_from"]), float(m["samples_to"]))
        out.append(
            _question(
                "samples",
                f"Which samples did rank {rank} train on at step {step}? (first and last sample id)",
                "The forward/backward row of that rank at that step names them.",
                "Each rank trains on its own slice of the data: the ranks never share a sample in a step.",
                expected=expected,
                tolerance=Tolerance(absolute=0),
                answer_text=f"{int(expected[0])}..{int(expected[1])}",
            )
        )
    losses = [s for s in steps if table.by_step[s][ranks[0]].get("loss") is not None]
    if losses:
        step = rng.choice(losses)
        loss = float(table.by_step[step][ranks[0]]["loss"] or 0.0)  # never None: losses holds logged ones
        out.append(
            _question(
                "local-loss",
                f"What was rank {ranks[0]}'s loss at step {step}? (4 decimals)",
                "It is local state: the forward/backward row of that rank.",
                "Each rank's loss is computed on its own batch, so the ranks' losses differ even though their "
                "weights do not.",
                expected=(loss,),
                tolerance=Tolerance(absolute=6e-5),
                answer_text=f"{loss:.4f}",
            )
        )
    return out
