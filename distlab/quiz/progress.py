"""Quiz and exercise progress as the quiz reads it: mastery per topic and the exercises passed, from the
learner's progress file (``distlab.progress_file``, which the exercises' checks write too).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..progress_file import ENV_VAR, ExerciseRecord, ProgressFile, QuestionRecord, progress_path
from .model import Question
from .topics import TOPICS

__all__ = [
    "ENV_VAR",
    "ExerciseProgress",
    "ExerciseRecord",
    "Progress",
    "QuestionRecord",
    "Summary",
    "TopicMastery",
    "progress_path",
]


class Progress(ProgressFile):
    """The progress file, read when made, with the quiz's summary of it."""

    def summary(self, questions: Iterable[Question], exercises: Iterable[tuple[str, str]] = ()) -> Summary:
        """Mastery of each topic over ``questions`` (the bank), and each exercise of ``(name, title)``."""
        by_topic: dict[str, list[Question]] = {topic: [] for topic in TOPICS}
        for question in questions:
            by_topic.setdefault(question.topic, []).append(question)
        rows = tuple(
            TopicMastery(
                topic=topic,
                title=TOPICS.get(topic, topic),
                questions=len(qs),
                answered=sum(q.id in self.records for q in qs),
                mastered=sum(self.mastered(q.id) for q in qs),
            )
            for topic, qs in by_topic.items()
        )
        done = tuple(
            ExerciseProgress(name, title, *_exercise_state(self.exercises.get(name))) for name, title in exercises
        )
        return Summary(path=self.path, topics=rows, exercises=done)


def _exercise_state(entry: ExerciseRecord | None) -> tuple[int, bool, bool]:
    return (entry.checks, entry.passed, entry.last_passed) if entry else (0, False, False)


@dataclass(frozen=True)
class TopicMastery:
    """One topic's line of the summary."""

    topic: str
    title: str
    questions: int
    answered: int
    mastered: int

    @property
    def mastery(self) -> float:
        """Share of the topic's questions whose last answer was right (0.0 to 1.0)."""
        return self.mastered / self.questions if self.questions else 0.0


@dataclass(frozen=True)
class ExerciseProgress:
    """One exercise's line of the summary."""

    name: str
    title: str
    checks: int
    passed: bool  # ever
    last_passed: bool


@dataclass(frozen=True, repr=False)
class Summary:
    """Mastery per topic and the exercises passed; its text form is two tables."""

    path: Path
    topics: tuple[TopicMastery, ...]
    exercises: tuple[ExerciseProgress, ...] = ()

    def __getitem__(self, topic: str) -> TopicMastery:
        for row in self.topics:
            if row.topic == topic:
                return row
        raise KeyError(f"no topic {topic!r}; topics: {', '.join(TOPICS)}")

    def __str__(self) -> str:
        width = max(len(row.topic) for row in self.topics)
        lines = [f"Quiz progress ({self.path})", f" #  {'topic':<{width}}  answered  mastered"]
        for number, row in enumerate(self.topics, 1):
            answered = f"{row.answered}/{row.questions}"
            lines.append(f"{number:>2}  {row.topic:<{width}}  {answered:>8}  {row.mastery:>8.0%}")
        if self.exercises:
            passed = sum(exercise.passed for exercise in self.exercises)
            width = max(len(exercise.name) for exercise in self.exercises)
            lines += ["", f"Exercises: {passed} of {len(self.exercises)} passed",
                      f" #  {'exercise':<{width}}  checks  result"]
            for number, exercise in enumerate(self.exercises, 1):
                state = "passed" if exercise.passed else ("not yet" if exercise.checks else "")
                lines.append(f"{number:>2}  {exercise.name:<{width}}  {exercise.checks:>6}  {state}")
        return "\n".join(lines)

    # IPython shows the repr: the table reads the same in a notebook, a terminal and a log.
    __repr__ = __str__
