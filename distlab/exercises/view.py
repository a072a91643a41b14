"""What ``%exercise`` shows: the list with the learner's progress, a task with its starter and hints."""

from __future__ import annotations

import html
from dataclasses import dataclass

from .catalog import EXERCISES, get
from .model import Exercise

__all__ = ["Overview", "TaskView", "hint", "overview", "show"]

# How many hints of each exercise this kernel has shown: hints come one at a time.
_hints_shown: dict[str, int] = {}


@dataclass(frozen=True, repr=False)
class Overview:
    """The exercises in course order, each with its lesson and the learner's result so far."""

    rows: tuple[tuple[str, str, str, int, str], ...]  # name, title, lesson, checks, result

    def __str__(self) -> str:
        width = max(len(row[0]) for row in self.rows)
        lines = [f" #  {'exercise':<{width}}  checks  result   lesson"]
        for number, (name, _title, lesson, checks, result) in enumerate(self.rows, 1):
            lines.append(f"{number:>2}  {name:<{width}}  {checks:>6}  {result:<7}  {lesson}")
        lines.append("%exercise NAME shows one; %exercise check NAME grades it on the ranks")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td>{n}</td><td><code>{html.escape(name)}</code></td><td style='text-align:left'>"
            f"{html.escape(title)}</td><td>{checks}</td><td>{result}</td>"
            f"<td><a href='{html.escape(lesson)}'>{html.escape(lesson)}</a></td></tr>"
            for n, (name, title, lesson, checks, result) in enumerate(self.rows, 1)
        )
        return (
            "<table><thead><tr><th>#</th><th>exercise</th><th>task</th><th>checks</th><th>result</th>"
            f"<th>lesson</th></tr></thead><tbody>{body}</tbody></table>"
            "<p><code>%exercise NAME</code> shows one; <code>%exercise check NAME</code> grades it on the ranks</p>"
        )


def overview() -> Overview:
    """The exercises and the learner's progress on each (from the saved progress)."""
    from ..progress_file import ProgressFile

    done = ProgressFile().exercises
    rows = []
    for exercise in EXERCISES.values():
        entry = done.get(exercise.name)
        result = "" if entry is None else ("passed" if entry.passed else "not yet")
        rows.append((exercise.name, exercise.title, exercise.lesson, entry.checks if entry else 0, result))
    return Overview(tuple(rows))


@dataclass(frozen=True, repr=False)
class TaskView:
    """An exercise's task, its starter cell and how to check it (text, Markdown and HTML)."""

    exercise: Exercise

    def _body(self) -> str:
        e = self.exercise
        count = len(e.hints)
        return (
            f"## Exercise `{e.name}`: {e.title}\n\n{e.task}\n\n"
            f"Start from this cell (lesson: [{e.lesson}]({e.lesson})):\n\n```python\n{e.starter.rstrip()}\n```\n\n"
            f"Check it with `%exercise check {e.name}`. {count} hint{'s' if count != 1 else ''}, one at a time: "
            f"`%exercise hint {e.name}`."
        )

    def _repr_markdown_(self) -> str:
        return self._body()

    def __str__(self) -> str:
        return self._body()

    __repr__ = __str__


def show(name: str) -> TaskView:
    """The task of exercise ``name`` (its text form, Markdown in a notebook)."""
    return TaskView(get(name))


def hint(name: str) -> str:
    """The next hint of exercise ``name`` not yet shown in this kernel ("Hint 2 of 3: ...")."""
    exercise = get(name)
    shown = _hints_shown.get(exercise.name, 0)
    if shown >= len(exercise.hints):
        return (
            f"all {len(exercise.hints)} hints of {exercise.name} are shown; the reference solution is kept out "
            "of view: the grader's feedback names what is wrong"
        )
    _hints_shown[exercise.name] = shown + 1
    return f"Hint {shown + 1} of {len(exercise.hints)}: {exercise.hints[shown]}"
