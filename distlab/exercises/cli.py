"""Headless grading for courses: ``python -m distlab.exercises grade NOTEBOOK.ipynb`` prints the grades as JSON.

The learner's notebook runs top to bottom in a fresh kernel (a failing cell does not stop it: the
grades say what was defined). Then, in that kernel, every exercise (or those named) is graded on the
lab the notebook started; an exercise whose names are not defined is "not attempted". The kernel's
exit stops the labs. The exit status is 0 when grading ran (whatever the grades), 2 when it could not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .catalog import EXERCISES
from .results import Grade

__all__ = ["grade_notebook", "main"]

_MARK = "distlab-grades:"


def grade_notebook(path: str, names: list[str] | None = None, timeout: float = 600.0) -> dict[str, Grade]:
    """Run the notebook at ``path`` in a fresh kernel, then grade it there: {name: grade as plain values}."""
    import nbformat
    from nbclient import NotebookClient

    # nbformat's read and new_code_cell are unannotated.
    notebook = nbformat.read(path, as_version=4)
    chosen = json.dumps(names)
    notebook.cells.append(nbformat.v4.new_code_cell(
        "import json as _json, distlab.exercises as _exercises\n"
        f"print({_MARK!r} + _json.dumps(_exercises.grade_all(names={chosen})))"
    ))
    folder = os.path.dirname(os.path.abspath(path))
    client = NotebookClient(
        notebook, timeout=timeout, allow_errors=True, kernel_name="python3", resources={"metadata": {"path": folder}}
    )
    client.execute()
    for output in notebook.cells[-1].get("outputs", []):
        for line in output.get("text", "").splitlines():
            if line.startswith(_MARK):
                grades: dict[str, Grade] = json.loads(line[len(_MARK):])
                return grades
    error = next((o for o in notebook.cells[-1].get("outputs", []) if o.get("output_type") == "error"), None)
    why = f"{error['ename']}: {error['evalue']}" if error else "the grading cell printed nothing"
    raise RuntimeError(f"grading {path} failed: {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.exercises", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    grade = sub.add_parser("grade", help="run a learner's notebook in a fresh kernel and print its grades as JSON")
    grade.add_argument("notebook", help="the learner's .ipynb")
    grade.add_argument("--exercise", action="append", choices=list(EXERCISES), help="grade only this one (repeat)")
    grade.add_argument("--timeout", type=float, default=600.0, help="seconds each cell of the notebook may run")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.notebook):
        print(f"error: no notebook at {args.notebook}: give the path of a .ipynb file", file=sys.stderr)
        return 2
    try:
        grades = grade_notebook(args.notebook, args.exercise, args.timeout)
    except ModuleNotFoundError as exc:
        print(f"error: headless grading needs {exc.name}: pip install nbclient", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a course's script reads one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    passed = sum(bool(g.get("passed")) for g in grades.values())
    print(json.dumps({"notebook": args.notebook, "passed": passed, "of": len(grades), "exercises": grades}, indent=1))
    return 0
