"""What ``%quiz`` calls: pick questions for a topic, check the request first, hand back the widget."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .. import checks
from .loader import Bank, bank
from .model import LabLike, Question
from .progress import Progress, Summary
from .topics import resolve_difficulty, resolve_topic

if TYPE_CHECKING:
    from .widget import QuizWidget

__all__ = ["choose_questions", "show", "summary"]


def _check_count(n: object) -> int | None:
    return None if n is None else checks.whole("the number of questions", n, minimum=1, example="n=5")


def choose_questions(
    questions: Bank,
    topic: str | int,
    n: int | None = None,
    difficulty: str | None = None,
    *,
    with_live: bool = False,
    progress: Progress | None = None,
    rng: random.Random | None = None,
) -> list[Question]:
    """Up to ``n`` questions of ``topic``, shuffled, the ones not yet mastered first.

    Live questions are left out unless ``with_live`` (they need a running lab). Raises ValueError, with
    the fix, when the request is malformed or nothing is left to ask.
    """
    slug, level, count = resolve_topic(topic), resolve_difficulty(difficulty), _check_count(n)
    candidates = list(questions.select(slug, level))
    level_words = f"{level} " if level else ""
    if not candidates:
        raise ValueError(f"there are no {level_words}questions on {slug}; try another --difficulty, or leave it out")
    askable = [q for q in candidates if with_live or not q.needs_lab]
    if not askable:
        raise ValueError(f"the {level_words}questions on {slug} are all live ones: run %dist start -n 2 first")
    (rng or random.Random()).shuffle(askable)
    if progress is not None:
        # sort is stable: shuffled order within "not mastered" and within "mastered".
        askable.sort(key=lambda q: progress.mastered(q.id))
    return askable[:count] if count else askable


def show(
    topic: str | int,
    n: int | None = None,
    difficulty: str | None = None,
    lab: LabLike | None = None,
    seed: int | None = None,
) -> QuizWidget:
    """A quiz widget on ``topic`` (slug or number 1-15): ``n`` questions (all by default) of ``difficulty``.

    With ``lab``, live questions graded on its ranks are included. Bad arguments raise ValueError before
    anything is shown. ``seed`` makes the choice, the order and the drawn numbers repeatable.
    """
    progress = Progress()
    rng = random.Random(seed)
    chosen = choose_questions(bank(), topic, n, difficulty, with_live=lab is not None, progress=progress, rng=rng)
    skipped = 0 if lab is not None else sum(q.needs_lab for q in bank().select(topic, difficulty))
    note = (
        f"{skipped} live question{'s' if skipped > 1 else ''} on this topic need a running lab: "
        "start one with %dist start -n 2 to include them."
        if skipped
        else ""
    )
    from .widget import QuizWidget  # ipywidgets is imported only when a quiz is shown

    return QuizWidget(
        chosen, topic=resolve_topic(topic), lab=lab, seed=rng.randrange(2**32), progress=progress, note=note
    )


def summary(exercises: Iterable[tuple[str, str]] | None = None) -> Summary:
    """Mastery per topic and the exercises, from the saved progress (its text form is tables).

    ``exercises``: the course's exercises as ``(name, title)``, each shown whether checked or not
    (``%quiz`` passes the catalog's: the quiz sits below the exercises, which grade on a lab, so it
    does not read their catalog itself); by default those the progress file holds, by name.
    """
    progress = Progress()
    listed = list(exercises) if exercises is not None else [(name, name) for name in sorted(progress.exercises)]
    return progress.summary(bank(), listed)
