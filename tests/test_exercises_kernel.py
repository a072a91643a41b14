"""%exercise in a real kernel, and headless grading of a learner's notebook in a fresh one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import psutil
import pytest
from _jupyter import execute
from conftest import ours
from jupyter_client.manager import start_new_kernel

from distlab import exercises

pytestmark = pytest.mark.cluster

SOLUTION = exercises.get("average-gradients").solution()


def _reply(kc, code: str, timeout: float = 180):
    shown: list[dict] = []
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=shown.append)
    return reply["content"], shown


def _text(messages: list[dict]) -> str:
    parts = []
    for msg in messages:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            parts.append(content["text"])
        elif msg["msg_type"] in ("execute_result", "display_data"):
            parts.append(content["data"].get("text/plain", ""))
    return "".join(parts)


def test_the_exercise_magic_lists_shows_hints_and_checks_on_the_running_lab():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        execute(kc, "%load_ext distlab")
        content, shown = _reply(kc, "%exercise")
        assert content["status"] == "ok" and "average-gradients" in _text(shown)

        content, shown = _reply(kc, "%exercise average-gradients")
        # The starter becomes the next cell (JupyterLab takes the payload) and shows in the task.
        payload = [p for p in content.get("payload", []) if p.get("source") == "set_next_input"]
        assert payload and payload[0]["text"] == exercises.get("average-gradients").starter
        markdown = next(m["content"]["data"] for m in shown if m["msg_type"] == "execute_result")
        assert "text/markdown" in markdown and "def average_gradients(model):" in markdown["text/markdown"]

        assert execute(kc, "%exercise hint average-gradients").startswith("Hint 1 of")

        content, shown = _reply(kc, "%exercise check average-gradients")
        assert content["status"] == "error" and "no lab is running" in content["evalue"]

        execute(kc, "%dist start -n 2", timeout=120)
        execute(kc, "%%ddp\n" + SOLUTION)
        content, shown = _reply(kc, "%exercise check average-gradients --seed 4", timeout=300)
        assert content["status"] == "ok", content
        result = next(m["content"]["data"] for m in shown if m["msg_type"] == "execute_result")
        assert "average-gradients: passed" in result["text/plain"] and "<table>" in result["text/html"]
        assert "1 of" in execute(kc, "import distlab; print(distlab.quiz.summary())")  # 1 of N passed

        for bad, why in (("%exercise check", "takes NAME"), ("%exercise nope", "there is no exercise 'nope'")):
            content, _ = _reply(kc, bad)
            assert content["status"] == "error" and why in content["evalue"], content
        assert execute(kc, "%%ddp\nprint(rank)").count("\n") == 2  # the lab works as before
    finally:
        km.shutdown_kernel(now=False)
        kc.stop_channels()


def _notebook(path: Path, *cells: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, path)


def test_headless_grading_runs_a_learners_notebook_and_prints_its_grades(tmp_path):
    notebook = tmp_path / "learner.ipynb"
    _notebook(
        notebook,
        "%load_ext distlab\n%dist start -n 2",
        "%%ddp\n" + SOLUTION,
        "raise ValueError('a learner cell that fails does not stop the grading')",
    )
    before = {p.pid for p in psutil.process_iter()}
    run = subprocess.run(
        [sys.executable, "-m", "distlab.exercises", "grade", str(notebook), "--exercise", "average-gradients",
         "--exercise", "ring-allreduce"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    grades = report["exercises"]
    assert grades["average-gradients"]["passed"] is True
    assert len(grades["average-gradients"]["cases"]) >= 4
    assert grades["ring-allreduce"] == {
        "passed": False, "attempted": False, "feedback": grades["ring-allreduce"]["feedback"]
    }
    assert "`ring_all_reduce` is not defined on the ranks" in grades["ring-allreduce"]["feedback"]
    assert report["passed"] == 1 and report["of"] == 2
    # The kernel's exit stopped both labs, the learner's and the grader's.
    left = [p for p in psutil.process_iter(["pid", "cmdline"]) if p.pid not in before and ours(p) and
            any("ipyparallel" in part or "distlab" in part for part in (p.info["cmdline"] or []))]
    assert not left, [p.info["cmdline"] for p in left]
