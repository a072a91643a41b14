"""distlab's exercises and quizzes as an nbgrader assignment, graded on live ranks by ``nbgrader autograde``.

``write_assignment(course_dir, name, exercises=[...], questions=[...])`` writes the *source* notebook,
``<course_dir>/source/<name>/<name>.ipynb``, that nbgrader's own commands take from there
(``generate_assignment``, ``release_assignment``, ``collect``, ``autograde``, ``generate_feedback``).
Its first cell starts a small lab; each exercise is its task, a ``%%ddp`` solution cell (the reference
between nbgrader's ``### BEGIN SOLUTION`` / ``### END SOLUTION``, which ``generate_assignment`` replaces
with its stub) and a locked test cell that grades the learner's definitions on ranks
(``distlab.exercises.check``) and prints what the grader measured, so that it lands in the feedback.
Each quiz question is its prompt, a solution cell setting ``answer_<n>``, and a locked test cell
grading that value with the quiz's own grading (``Attempt.check``); numbers are drawn once, here,
and written into the test cell, so every learner answers the same prompt.

nbgrader gives a test cell its points when its outputs hold no error and nothing on stderr: the
cells below print to stdout only, and ``assert`` the verdict.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypedDict

if TYPE_CHECKING:
    from ..exercises.model import Exercise
    from ..quiz.loader import Bank
    from ..quiz.model import Attempt, Question

__all__ = ["AssignmentError", "main_assignment", "write_assignment"]

#: nbgrader's cell metadata schema this writes (nbgrader 0.9 reads versions 1 to 3, and writes 3).
_SCHEMA_VERSION = 3
# An assignment's name is a folder of the course and part of the exchange's paths: letters, digits, . _ -
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class _NbgraderMeta(TypedDict, total=False):
    """nbgrader's metadata of a cell (schema version 3)."""

    grade: bool
    grade_id: str
    locked: bool
    schema_version: int
    solution: bool
    points: int  # test cells


class _CellMeta(TypedDict):
    nbgrader: _NbgraderMeta


class _Cell(TypedDict, total=False):
    """A notebook cell (nbformat 4.5): code cells have an execution count and outputs."""

    cell_type: str  # "code" or "markdown"
    id: str
    metadata: _CellMeta
    source: str
    execution_count: None
    outputs: list[object]


class AssignmentError(ValueError):
    """Bad input to :func:`write_assignment`: the message is one line saying what to change."""


def write_assignment(
    course_dir: str | Path,
    name: str,
    exercises: Sequence[str] = (),
    questions: Sequence[str] = (),
    *,
    ranks: int = 2,
    exercise_points: int = 5,
    question_points: int = 1,
    overwrite: bool = False,
) -> Path:
    """Write the source notebook of assignment ``name`` into the nbgrader course at ``course_dir``.

    ``exercises`` are names of :mod:`distlab.exercises` (``average-gradients``), ``questions`` ids of the
    quiz bank (``batch-and-lr/global-batch``). ``ranks`` is the size of the lab the notebook starts
    (live questions run on it; the exercises are graded on ranks of the grader's own). An existing
    notebook is kept (an instructor may have edited it) unless ``overwrite``. Returns its path.
    """
    from ..exercises import catalog
    from ..quiz import bank

    course = Path(course_dir)
    if not course.is_dir():
        raise AssignmentError(
            f"no course directory at {course}: give the folder that holds nbgrader_config.py "
            "(nbgrader quickstart COURSE makes one)"
        )
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AssignmentError(
            f"assignment name {name!r} is not a folder name nbgrader can use: letters, digits, '.', '_' and '-', "
            "e.g. ps1"
        )
    if not exercises and not questions:
        raise AssignmentError("the assignment is empty: give at least one exercise or question")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise AssignmentError(f"ranks must be a whole number >= 2, the ranks of the learner's lab (got {ranks!r})")
    for what, value in (("exercise_points", exercise_points), ("question_points", question_points)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AssignmentError(f"{what} must be a whole number >= 1 (got {value!r})")
    chosen = [_exercise(catalog.get, e) for e in _unique("exercise", exercises)]
    the_bank = bank()
    picked = [_question(the_bank, q, ranks) for q in _unique("question", questions)]

    path = course / "source" / name / f"{name}.ipynb"
    if path.exists() and not overwrite:
        raise AssignmentError(f"{path} exists: delete it, or write it again with overwrite=True (--force)")
    cells: list[_Cell] = [_intro(name, ranks, chosen, picked), _lab_cell(ranks)]
    for number, exercise in enumerate(chosen, 1):
        cells += _exercise_cells(number, exercise, exercise_points)
    for number, question in enumerate(picked, 1):
        cells += _question_cells(number, question, name, ranks, question_points)
    cells.append(_stop_cell())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_notebook(cells), indent=1) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- choosing


def _unique(what: str, names: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for item in names:
        if item in seen:
            raise AssignmentError(f"{what} {item!r} is named twice: name each {what} once")
        seen.append(item)
    return seen


def _exercise(get: Callable[[str], Exercise], name: str) -> Exercise:
    try:
        return get(name)
    except ValueError as exc:
        raise AssignmentError(str(exc)) from None


def _question(the_bank: Bank, question_id: str, ranks: int) -> Question:
    if question_id not in the_bank:
        ids = [q.id for q in the_bank]
        close = difflib.get_close_matches(str(question_id), ids, n=3)
        guess = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        topics = sorted({q.topic for q in the_bank})
        raise AssignmentError(
            f"there is no question {question_id!r} in the quiz bank{guess} Its ids are TOPIC/NAME, the topics: "
            f"{', '.join(topics)} (--list prints every id)"
        )
    question = the_bank.get(question_id)
    least = getattr(question, "min_world_size", 1)
    if question.needs_lab and least > ranks:
        raise AssignmentError(f"question {question_id!r} runs on {least} ranks or more: give ranks={least} (--ranks)")
    return question


# ---------------------------------------------------------------------------- cells


def _notebook(cells: list[_Cell]) -> dict[str, object]:
    return {
        "cells": cells,
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _cell(kind: str, source: str, grade_id: str, *, solution: bool = False, points: int = 0) -> _Cell:
    """A cell nbgrader knows: a solution cell, a test cell (``points``), or a locked one (task text, set-up)."""
    meta: _NbgraderMeta = {
        "grade": points > 0,
        "grade_id": grade_id,
        "locked": not solution,  # test cells and the text: nbgrader puts them back as written at autograde
        "schema_version": _SCHEMA_VERSION,
        "solution": solution,
    }
    if points:
        meta["points"] = points
    cell: _Cell = {"cell_type": kind, "id": grade_id, "metadata": {"nbgrader": meta}, "source": source}
    if kind == "code":
        cell["execution_count"] = None
        cell["outputs"] = []
    return cell


def _intro(name: str, ranks: int, exercises: list[Exercise], questions: list[Question]) -> _Cell:
    parts = []
    if exercises:
        parts.append(f"{len(exercises)} exercise{'s' if len(exercises) > 1 else ''}")
    if questions:
        parts.append(f"{len(questions)} question{'s' if len(questions) > 1 else ''}")
    text = (
        f"# {name}\n\n{' and '.join(parts)}, graded on live ranks. Run the next cell first: it starts "
        f"your lab, {ranks} ranks on this machine. Write your code where a cell says `# YOUR CODE HERE` "
        "(delete the `raise NotImplementedError()` under it), and run each test cell to see how you did: "
        "the same tests grade your submission."
    )
    return _cell("markdown", text, "distlab-intro")


def _lab_cell(ranks: int) -> _Cell:
    return _cell("code", f"%load_ext distlab\n%dist start -n {ranks}", "distlab-lab")


def _stop_cell() -> _Cell:
    # Stopped here, the lab and the grader's labs end inside the notebook's run: at autograde nbclient
    # gives a kernel 5 s to exit before it kills it, which may be too few to stop them all (distlab's
    # reaper would end them, but the lab's state file would stay behind).
    text = "# Ends your lab and the grader's ranks: run it when you are done.\n%dist stop"
    return _cell("code", text, "distlab-stop")


def _exercise_cells(number: int, exercise: Exercise, points: int) -> list[_Cell]:
    hints = "".join(
        f"\n\n<details><summary>Hint {i}</summary>\n\n{hint}\n\n</details>" for i, hint in enumerate(exercise.hints, 1)
    )
    starter = exercise.starter.rstrip("\n")
    task = (
        f"## Exercise {number}: {exercise.title}\n\n{exercise.task}\n\n"
        f"Write it in the `%%ddp` cell below (it runs on every rank of your lab), starting from:\n\n"
        f"```python\n{starter}\n```\n\n"
        f"The cell after it grades what your ranks define ({_names(exercise.defines)}) on ranks of the "
        f"grader's own, in worlds of {' and '.join(map(str, exercise.world_sizes))} ranks; "
        f"`%exercise {exercise.name}` shows the task again.{hints}"
    )
    solution = exercise.solution().rstrip("\n")
    # %%ddp stays the first line: nbgrader replaces only the lines between the markers, so the learner's
    # cell is still a %%ddp cell, whose stub raises NotImplementedError on every rank until it is written.
    code = f"%%ddp\n### BEGIN SOLUTION\n{solution}\n### END SOLUTION"
    test = (
        f"# Graded on live ranks: distlab takes {_names(exercise.defines)} from this notebook's lab and runs\n"
        "# the grader's cases on ranks of its own; what it measured is printed, for the feedback.\n"
        "from distlab.exercises import check\n\n"
        f"_result = check({exercise.name!r}, record=False)\n"
        "print(_result)\n"
        "assert _result.passed, _result.feedback"
    )
    slug = exercise.module.replace("_", "-")
    return [
        _cell("markdown", task, f"{slug}-task"),
        _cell("code", code, f"{slug}-code", solution=True),
        _cell("code", test, f"{slug}-test", points=points),
    ]


def _question_cells(number: int, question: Question, name: str, ranks: int, points: int) -> list[_Cell]:
    # Drawn once, from the assignment and the question: the same notebook each time it is written.
    attempt = question.draw(seed=zlib.crc32(f"{name}/{question.id}".encode()), lab=_Planned(ranks))
    variable = f"answer_{number}"
    text = f"## Question {number}\n\n{attempt.prompt}"
    if attempt.code:
        text += f"\n\n```python\n{attempt.code.rstrip()}\n```"
    if attempt.choices:
        text += "\n\n" + "\n".join(f"- `{option.id}`: {option.text}" for option in attempt.choices)
    text += f"\n\n{_how_to_answer(question, attempt, variable)}"
    params = dict(attempt.params)
    lab = "lab=distlab.current_lab(), " if question.needs_lab else ""
    draw = f"bank().get({question.id!r}).draw({lab}params={params!r})"
    if question.needs_lab:
        # Only the ranks know it: the reference answer is what they hold when the question's code runs.
        reference = f"import distlab\nfrom distlab.quiz import bank\n\n{variable} = {draw}.answer()"
    else:
        reference = f"{variable} = {attempt.answer()!r}"
    solution = f"### BEGIN SOLUTION\n{reference}\n### END SOLUTION"
    test = (
        "# Graded by distlab's quiz" + (", against what your lab's ranks hold" if question.needs_lab else "") + ".\n"
        + ("import distlab\n" if question.needs_lab else "")
        + "from distlab.quiz import bank\n\n"
        f"_verdict = {draw}.check({variable})\n"
        "print(_verdict.feedback)\n"
        "assert _verdict.correct, _verdict.feedback"
    )
    slug = f"q{number}"
    return [
        _cell("markdown", text, f"{slug}-prompt"),
        _cell("code", solution, f"{slug}-answer", solution=True),
        _cell("code", test, f"{slug}-test", points=points),
    ]


def _how_to_answer(question: Question, attempt: Attempt, variable: str) -> str:
    from ..quiz.live import LiveQuestion

    kind = f"live-{question.response}" if isinstance(question, LiveQuestion) else question.kind
    if kind in ("single", "live-choice"):
        how = f'the id of the right option: `{variable} = "<id>"`'
    elif kind == "multiple":
        how = f'a list of the ids of every right option: `{variable} = ["<id>", ...]`'
    elif kind == "ordering":
        how = f'a list of all {len(attempt.choices)} ids, in order: `{variable} = ["<first id>", ...]`'
    else:
        unit = f" in {attempt.unit}" if attempt.unit else ""
        several = " (a list, for several numbers)" if question.needs_lab else ""
        how = f"the number{unit}{several}"
    where = " Your lab's ranks run it when the answer is graded." if question.needs_lab else ""
    return f"Set `{variable}` to {how}, in the cell below.{where}"


def _names(names: Sequence[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


class _Planned:
    """The lab the notebook will start, for drawing a live question's prompt: its size, and nothing runs."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def run(
        self,
        code: str,
        ranks: str | int | Iterable[int] | None = None,
        timeout: float | None = None,
        record: bool = True,
    ) -> Mapping[int, object]:
        raise RuntimeError("the assignment's notebook is being written: no lab runs yet")


# ---------------------------------------------------------------------------- the instructor's command


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's usage block and line become one line
        raise _Refused(f"{message} (--help shows the options)")


def _listing() -> str:
    from ..exercises import names
    from ..quiz import bank

    rows = ["exercises (--exercise):", *(f"  {n}" for n in names()), "questions (--question):"]
    rows += [f"  {q.id}  [{q.kind}]" for q in bank()]
    return "\n".join(rows)


def main_assignment(argv: Sequence[str] | None = None) -> int:
    """``python -m distlab.classroom assignment --course DIR --name NAME --exercise X --question ID``.

    Prints the notebook's path and the next nbgrader command; 2 and one line on stderr for bad input.
    """
    parser = _Parser(
        prog="python -m distlab.classroom assignment",
        description="Write an nbgrader source assignment of distlab exercises and quiz questions, graded on ranks.",
    )
    parser.add_argument("--course", default=".", help="the nbgrader course directory (default: here)")
    parser.add_argument("--name", help="the assignment's name, e.g. ps1")
    parser.add_argument("--exercise", action="append", default=[], help="an exercise, e.g. average-gradients (repeat)")
    parser.add_argument("--question", action="append", default=[], help="a quiz question id (repeat)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the lab the notebook starts (default 2)")
    parser.add_argument("--exercise-points", type=int, default=5, help="points per exercise (default 5)")
    parser.add_argument("--question-points", type=int, default=1, help="points per question (default 1)")
    parser.add_argument("--force", action="store_true", help="write over an existing source notebook")
    parser.add_argument("--list", action="store_true", help="print the exercises and question ids, and exit")
    try:
        args = parser.parse_args(argv)
        if args.list:
            print(_listing())
            return 0
        if not args.name:
            raise _Refused("give the assignment's name: --name NAME, e.g. --name ps1")
        path = write_assignment(
            args.course, args.name, args.exercise, args.question, ranks=args.ranks,
            exercise_points=args.exercise_points, question_points=args.question_points, overwrite=args.force,
        )
    except (_Refused, AssignmentError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}\nnext: nbgrader generate_assignment {args.name} (in {Path(args.course).resolve()})")
    return 0
