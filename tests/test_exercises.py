"""The exercises' catalog, texts, grader contracts, results, progress, hints and failure messages (no process)."""

from __future__ import annotations

import ast
import json
import pickle
import re
from pathlib import Path

import pytest
from _exercises import ALL, each_exercise, exercise_tests

from distlab import exercises
from distlab.errors import RankFailure
from distlab.exercises import grading
from distlab.exercises.cli import main
from distlab.exercises.results import CaseResult, ExerciseResult
from distlab.notebook.script import CellRan
from distlab.quiz.progress import Progress
from distlab.quiz.session import summary

ROOT = Path(__file__).resolve().parents[1]


def test_the_catalog_has_the_exercises_in_course_order():
    assert exercises.names() == [
        "average-gradients", "distributed-sampler", "ring-allreduce", "parameter-server", "ddp-from-hooks", "zero-1",
        "tensor-parallel-mlp", "pipeline-1f1b", "diverged-replicas", "clip-sharded-gradients", "expert-dispatch",
        "diloco-outer-step", "ddp-comm-hook", "fsdp-shard-sizes", "atomic-checkpoint",
    ]
    assert all(exercise.module == exercise.name.replace("-", "_") for exercise in ALL)


def test_each_exercise_is_one_folder_with_its_task_solution_and_grader():
    folder = ROOT / "distlab" / "exercises"
    assert sorted(p.parent.name for p in folder.glob("*/task.py")) == sorted(e.module for e in ALL)  # none missed
    for exercise in ALL:
        files = {p.name for p in (folder / exercise.module).iterdir()}
        assert {"__init__.py", "task.py", "solution.py", "grader.py"} <= files, exercise.module


@pytest.mark.cluster
def test_a_rank_that_imports_a_grader_loads_no_notebook_side_and_no_task():
    from conftest import python_lines

    # What rank/exercise.py does on a rank of the grader's lab: import the grader by the exercise's name.
    # Its folder and the package above it load too (their __init__ imports nothing); nothing else of
    # distlab.exercises (the catalog, grading, the tasks) nor of the notebook's side may.
    allowed = {"distlab.exercises"} | {f"distlab.exercises.{e.module}" for e in ALL}
    # The modules a grader imports from its own folder: atomic-checkpoint's saving process and states,
    # what ddp-from-hooks watches of backward, pipeline-1f1b's recorded schedule.
    parts = ("grader", "saver", "states", "backward_watch", "schedule")
    allowed |= {f"distlab.exercises.{e.module}.{part}" for e in ALL for part in parts}
    code = (
        "import sys\n"
        "from distlab.rank.exercise import _grader\n"
        f"for name in {[e.name for e in ALL]!r}:\n"
        "    _grader(name).cases(2, 1)\n"
        "notebook = ('distlab.notebook', 'distlab.dashboard', 'distlab.server', 'distlab.quiz', 'distlab.exercises')\n"
        "print(sorted(m for m in sys.modules if m.startswith(notebook)))\n"
    )
    loaded = ast.literal_eval(python_lines(code, timeout_s=300)[-1])
    assert {f"distlab.exercises.{e.module}.grader" for e in ALL} <= set(loaded)
    assert sorted(set(loaded) - allowed) == []


@each_exercise
def test_the_last_hint_names_the_idea_and_leaves_the_code_to_the_learner(exercise):
    # Hints go from the tool to the idea; the last must not be the solution in prose: none of its code
    # spans is a statement (an assignment, a loop, a return, two statements on a line), and none of
    # the reference solution's lines is in it.
    last = exercise.hints[-1]
    for span in re.findall(r"`([^`]+)`", last):
        assert not re.search(r"(?<![=!<>])=(?!=)|\bfor\b|\breturn\b|;", span), span
    for line in exercise.solution().splitlines():
        code = line.split("#")[0].strip()
        assert len(code) < 20 or code not in last, code


@each_exercise
def test_each_exercise_reads_whole_and_its_solution_defines_what_it_asks(exercise):
    assert exercise.title and len(exercise.task) > 200 and exercise.hints
    assert exercise.starter.startswith("%%ddp\n")
    assert (ROOT / "notebooks" / exercise.lesson).is_file(), exercise.lesson
    assert all(2 <= size <= 4 for size in exercise.world_sizes)
    for code in (exercise.solution(), exercise.starter.removeprefix("%%ddp\n")):
        tree = ast.parse(code)
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert set(exercise.defines) <= defined
    for name in exercise.defines:
        assert name in exercise.task, f"the task never names {name}"


@each_exercise
def test_each_grader_draws_the_same_cases_from_a_seed_and_other_cases_from_another(exercise):
    from importlib import import_module

    grader = import_module(f"distlab.exercises.{exercise.module}.grader")
    assert callable(grader.grade)
    for size in exercise.world_sizes:
        cases = grader.cases(size, 5)
        assert cases and all(isinstance(case["name"], str) and case["name"] for case in cases)
        assert json.loads(json.dumps(cases)) == cases  # plain values: the same on every rank
        assert grader.cases(size, 5) == cases
    drawn = [json.dumps(grader.cases(exercise.world_sizes[0], seed)) for seed in range(4)]
    assert len(set(drawn)) > 1, "the cases never change with the seed"


def test_an_unknown_exercise_is_one_line_naming_them_all():
    with pytest.raises(ValueError, match="there is no exercise 'ring'; the exercises are: average-gradients"):
        exercises.get("ring")
    assert exercises.get("average_gradients").name == "average-gradients"


def test_hints_come_one_at_a_time_then_say_they_are_all_shown(monkeypatch):
    monkeypatch.setattr("distlab.exercises.view._hints_shown", {})
    exercise = exercises.get("average-gradients")
    shown = [exercises.hint("average-gradients") for _ in exercise.hints]
    assert shown == [f"Hint {i} of {len(exercise.hints)}: {h}" for i, h in enumerate(exercise.hints, 1)]
    assert exercises.hint("average-gradients").startswith(f"all {len(exercise.hints)} hints")


def test_the_task_view_shows_the_text_the_starter_and_how_to_check():
    text = exercises.show("average-gradients")._repr_markdown_()
    exercise = exercises.get("average-gradients")
    assert exercise.task in text and exercise.starter.rstrip() in text
    assert "%exercise check average-gradients" in text and exercise.solution().strip() not in text


def _result(passed: bool) -> ExerciseResult:
    cases = (
        CaseResult(0, 2, "mlp <b>", True, measured={"seconds": 0.0123}),
        CaseResult(
            1, 2, "deep", passed, "" if passed else "`w`'s gradient is 2 times DDP's", rank=None if passed else 1
        ),
        CaseResult(2, 3, "mlp", passed, "" if passed else "not run: an earlier case was stopped", ran=passed),
    )
    return grading._verdict(exercises.get("average-gradients"), cases, seed=11)


def test_a_result_says_the_first_failure_its_case_and_rank():
    result = _result(passed=False)
    assert not result.passed
    assert result.feedback == "case 2 (deep, 2 ranks) on rank 1: `w`'s gradient is 2 times DDP's (1 case not run)"
    assert [c.verdict for c in result.cases] == ["passed", "FAILED", "not run"]
    html = result._repr_html_()
    assert "mlp &lt;b&gt;" in html and "seconds 0.0123" in html
    data = json.loads(json.dumps(result.to_dict()))
    assert data["passed"] is False and data["seed"] == 11 and data["cases"][1]["rank"] == 1


def test_a_result_passes_only_when_every_case_ran_and_passed():
    result = _result(passed=True)
    assert result.passed and result.feedback == "all 3 cases passed, in worlds of 2 and 3 ranks"


def test_exercise_progress_is_kept_with_the_quiz_progress_and_summarised():
    Progress().record("scaling/speed-up", True)
    Progress().record_exercise("average-gradients", False)
    Progress().record_exercise("average-gradients", True)
    Progress().record_exercise("average-gradients", False)
    again = Progress()
    assert set(again.records) == {"scaling/speed-up"}
    entry = again.exercises["average-gradients"]
    assert (entry.checks, entry.passed, entry.last_passed) == (3, True, False)
    text = str(summary())
    assert "Exercises: 1 of" in text
    assert any(line.split()[1:] == ["average-gradients", "3", "passed"] for line in text.splitlines() if line.strip())
    assert "passed" in str(exercises.overview())


def test_a_progress_file_from_before_exercises_still_reads(tmp_path, monkeypatch):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"version": 1, "questions": {"q": {"attempts": 1, "right": 1, "last_right": True,
                                                                   "last_seen": 0.0}}}))
    monkeypatch.setenv("DISTLAB_QUIZ_PROGRESS", str(path))
    progress = Progress()
    assert progress.mastered("q") and progress.exercises == {}
    progress.record_exercise("average-gradients", True)
    assert json.loads(path.read_text())["questions"]["q"]["right"] == 1


class _Lab:
    def __init__(self, *cells: str) -> None:
        self.history = tuple(CellRan(code) for code in cells)


def test_the_learners_line_is_quoted_from_the_latest_cell_that_defines_the_function():
    old = "def f(t):\n    dist.send(t, 1)\n"
    new = "\n\nimport os\n\ndef f(t):\n    x = 1\n    dist.recv(t, 1 - rank)\n"
    quote = grading._quoter(_Lab(old, "print(1)", new, "x = (\n"))
    assert quote("f", 5) == "dist.recv(t, 1 - rank)"  # leading empty lines dropped, as IPython does
    assert quote("g", 1) == "" and quote("f", 99) == ""


TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "<your code>", line 4, in f\n'
    '  File "/x/torch/distributed/c10d_logger.py", line 85, in wrapper\n'
    "KeyboardInterrupt\n"
)


def test_a_deadlock_names_each_stuck_rank_and_the_line_it_waits_on():
    quote = grading._quoter(_Lab("def f(t):\n    x = 1\n    y = 2\n    dist.recv(t, 1 - rank)\n"))
    failures = {r: RankFailure(r, "Stopped", "stopped by distlab", TRACEBACK) for r in (0, 1)}
    failures[2] = RankFailure(2, "Stopped", "stopped by distlab", "")
    message = grading._stuck(failures, quote, "stopped after 5 s")
    assert message.startswith(
        "ranks 0, 1 never returned from line 4 of f: `dist.recv(t, 1 - rank)`; rank 2 never returned, stopped after 5 s"
    )


def test_an_exception_in_the_learners_code_is_named_with_its_line_and_its_cause_rank():
    failures = {
        0: RankFailure(0, "Stopped", "stopped by distlab: rank 1 failed", ""),
        1: RankFailure(1, "ValueError", "bad", TRACEBACK),
    }
    rank, failure = grading._first_cause(failures)
    assert rank == 1
    assert grading._raised(failure, lambda f, n: "") == "raised ValueError: bad at line 4 of f"


def test_headless_grading_of_a_missing_notebook_is_one_line(capsys, tmp_path):
    assert main(["grade", str(tmp_path / "none.ipynb")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no notebook at" in err


def test_definitions_unpacked_on_a_rank_see_that_ranks_names_and_are_named_as_the_learners(monkeypatch):
    import cloudpickle

    from distlab.rank import exercise as rank_side
    from distlab.rank import namespace

    where: dict[str, object] = {"__name__": "__main__", "world_size": 4, "rank": 0}
    exec(  # noqa: S102 - a learner's cell, as an engine runs it
        "def helper():\n    return world_size * 10 + rank\n"
        "class Box:\n    def size(self):\n        return helper()\n"
        "def f():\n    return Box().size()\n",
        where,
    )
    blob = cloudpickle.dumps({"f": where["f"]})
    # This rank's namespace, whether or not an earlier test left an IPython shell in this process
    # (with one, the rank side reads the shell's user_ns, as on an engine).
    rank_names = {"world_size": 3, "rank": 2, "other": 1}
    monkeypatch.setattr(namespace, "_fallback", rank_names)
    monkeypatch.setattr(rank_side, "user_namespace", lambda: rank_names)
    learner = rank_side.Learner(blob)
    assert learner["f"]() == 32  # this rank's world_size and rank, not the learner lab's
    assert learner["f"].__code__.co_filename == "<your code>"
    assert "other" not in learner["f"].__globals__
    assert pickle.loads(blob)["f"]() == 40  # the blob itself is as it was packed


@each_exercise
def test_each_exercise_has_a_test_file_naming_the_mistakes_its_grader_must_catch(exercise):
    tests = exercise_tests(exercise)  # test_exercise_<module>.py, read by test_exercises_graded.py
    assert tests.harness.name == exercise.name
    assert tests.MISTAKES, f"{exercise.name} has no mistake to grade"
    for code, named in tests.MISTAKES.values():
        assert named and code.strip() and code != exercise.solution()
