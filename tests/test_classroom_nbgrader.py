"""An nbgrader assignment of distlab's exercise and quiz: the instructor's command that writes it, and
each kind of question's test cell; the course's configuration and nbgrader's runner, which the flow
across a hub's real learners uses (tests/test_classroom_grading.py: released, fetched, submitted,
autograded on live ranks, feedback fetched, once, end to end).
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from distlab.classroom.assignment import main_assignment, write_assignment
from distlab.quiz import bank

COURSE_ID = "dist101"
NAME = "ps1"
EXERCISE = "average-gradients"
QUESTIONS = ("batch-and-lr/global-batch", "torch-distributed-api/live-broadcast")
# The mistake the exercise's task warns of: the ranks' gradients summed, never divided.
SUMS_ONLY = """%%ddp
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
"""


def config_text(exchange: Path, learner: str | None = None) -> str:
    """A course's (or a learner's) nbgrader_config.py: the course, its exchange, a cell's time."""
    # On a hub each learner is a user of their own, whose name nbgrader reads from the system; in
    # one user's test, a learner's id is said.
    who = f"c.CourseDirectory.student_id = {learner!r}\n" if learner else ""
    return (
        "c = get_config()\n" + who +
        f"c.CourseDirectory.course_id = {COURSE_ID!r}\n"
        f"c.Exchange.root = {str(exchange)!r}\n"
        "c.Exchange.path_includes_course = True\n"
        # A learner's notebook starts a lab, then the grader's labs (2 and 3 ranks) at its first check:
        # nbgrader's 30 s per cell is too short on a busy 2-core machine.
        "c.ExecutePreprocessor.timeout = 600\n"
    )


def nbgrader(cwd: Path, home: Path, *args: str) -> str:
    # nbgrader runs `alembic` by name for its gradebook: the environment's bin folder comes first, as in
    # an activated one.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, "HOME": str(home), "PATH": path}
    run = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=1200, check=False,
    )
    assert run.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{run.stdout}\n{run.stderr}"
    return run.stdout + run.stderr


def _solutions(notebook: Path) -> dict[str, str]:
    """The source's solution cells without nbgrader's markers: what a learner who knows it types."""
    nb = nbformat.read(notebook, as_version=4)
    return {
        cell.metadata.nbgrader["grade_id"]: "\n".join(
            line for line in cell.source.splitlines() if "BEGIN SOLUTION" not in line and "END SOLUTION" not in line
        )
        for cell in nb.cells
        if cell.metadata.get("nbgrader", {}).get("solution")
    }


def _text(page: str) -> str:
    """The words of an HTML page, as a learner reads them."""
    page = re.sub(r"<(style|script)\b.*?</\1>", "", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def test_the_instructors_command_writes_the_notebook_or_says_in_one_line_what_is_wrong(tmp_path, capsys):
    args = ["--course", str(tmp_path), "--name", NAME, "--exercise", EXERCISE]
    assert main_assignment([*args, "--question", "batch-and-lr/global-batch"]) == 0
    notebook = nbformat.read(tmp_path / "source" / NAME / f"{NAME}.ipynb", as_version=4)
    nbformat.validate(notebook)
    graded = {c.metadata.nbgrader["grade_id"]: c.metadata.nbgrader.get("points") for c in notebook.cells
              if c.metadata.nbgrader["grade"]}
    assert graded == {"average-gradients-test": 5, "q1-test": 1}
    assert main_assignment(args) == 2  # written already: an instructor's edits are kept
    assert main_assignment([*args, "--force"]) == 0
    capsys.readouterr()

    for bad, says in (
        (["--course", str(tmp_path), "--name", "x", "--exercise", "ring"], "the exercises are: average-gradients,"),
        (["--course", str(tmp_path), "--name", "x", "--question", "batch-and-lr/global"],
         "did you mean 'batch-and-lr/global-batch'"),
        (["--course", str(tmp_path / "nowhere"), "--name", "x", "--exercise", EXERCISE], "no course directory"),
        (["--course", str(tmp_path), "--name", "p s", "--exercise", EXERCISE], "not a folder name"),
        (["--course", str(tmp_path), "--name", "x"], "the assignment is empty"),
    ):
        assert main_assignment(bad) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err


def test_the_listing_names_what_an_assignment_can_hold(capsys):
    assert main_assignment(["--list"]) == 0
    out = capsys.readouterr().out
    assert "  average-gradients" in out and "  batch-and-lr/global-batch  [numeric]" in out


def test_each_kind_of_question_is_graded_by_its_test_cell_the_reference_passing_and_a_wrong_answer_not(tmp_path):
    kinds = ("why-distribute/clearest-case", "why-distribute/good-reasons", "batch-and-lr/global-batch")
    ordering = next(q.id for q in bank() if q.kind == "ordering")
    source = write_assignment(tmp_path, NAME, questions=[*kinds, ordering])
    cells = {c.metadata.nbgrader["grade_id"]: c.source for c in nbformat.read(source, as_version=4).cells}
    reference = _solutions(source)
    for number in range(1, 5):
        namespace: dict[str, object] = {}
        exec(reference[f"q{number}-answer"], namespace)  # noqa: S102 - the notebook's own cells, as a kernel runs them
        exec(cells[f"q{number}-test"], namespace)  # noqa: S102
        namespace[f"answer_{number}"] = ["no-such-option"] if number != 3 else -1
        with pytest.raises(AssertionError, match=r"Not quite|Pick|Give all"):
            exec(cells[f"q{number}-test"], namespace)  # noqa: S102
