"""binder/ works: a fresh virtual environment built from what binder/environment.yml lists (the pip
equivalent of each conda package), binder/postBuild run in it, and the start-here notebook run
there from top to bottom, its memory measured against mybinder's ~2 GB.

Slow (a new environment: about 2-4 minutes with pip's cache warm), so a broken binder/ fails CI
rather than a learner's first click.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest
import tomllib
import yaml

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
BINDER = REPO / "binder"
NOTEBOOK = REPO / "notebooks" / "00-start-here.ipynb"
# mybinder.org gives a session about 2 GB; the notebook's processes (kernel, controller, 2 ranks)
# must leave room for the Jupyter server and a margin.
MEMORY_BUDGET_BYTES = 1.5e9

# conda-forge name -> pip name; None: not a Python package (checked otherwise, or pip's own).
PIP_NAMES: dict[str, str | None] = {
    "pytorch-cpu": "torch", "matplotlib-base": "matplotlib", "python": None, "nodejs": None, "pip": None,
}


def _conda_specs() -> list[str]:
    env = yaml.safe_load((BINDER / "environment.yml").read_text())
    assert env["channels"][0] == "conda-forge", env["channels"]
    return [d for d in env["dependencies"] if isinstance(d, str)]


def _split(spec: str) -> tuple[str, str]:
    name, constraint = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", spec).groups()  # type: ignore[union-attr]
    return name, constraint.replace(" ", "")


def _pip_requirements() -> list[str]:
    reqs = []
    for spec in _conda_specs():
        name, constraint = _split(spec)
        pip_name = PIP_NAMES.get(name, name)
        if pip_name is not None:
            reqs.append(pip_name + ("==" + constraint[1:] if constraint.startswith("=") and
                                    not constraint.startswith("==") else constraint))
    return reqs


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_binder_lists_every_dependency_of_distlab_so_pip_installs_none() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = {_normal(_split(r)[0]) for r in _pip_requirements()}
    missing = [d for d in project["dependencies"] if _normal(_split(d)[0]) not in listed]
    assert not missing, f"add to binder/environment.yml (conda-forge names): {missing}"
    assert "pytorch-cpu" in {_split(s)[0] for s in _conda_specs()}  # never a CUDA build on Binder
    assert os.access(BINDER / "postBuild", os.X_OK)


@pytest.mark.timeout(900)
def test_start_here_notebook_runs_in_a_fresh_binder_environment(tmp_path: Path) -> None:
    if shutil.which("node") is None:
        pytest.skip("postBuild builds the JupyterLab extension with Node.js: install Node.js 20+")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(venv))
    env.pop("PYTHONPATH", None)
    # conda-forge's CPU PyTorch <-> this machine's CPU torch wheel (PyPI's default build brings CUDA).
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={version('torch')}\n")
    # --no-compile: the environment's own packages are not byte-compiled up front (torch alone is thousands
    # of files); what the notebook imports is compiled as it is imported, as on a first run anywhere.
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile", "-c", str(constraints)]
    _run([*pip, *_pip_requirements()], env, REPO, timeout=600)
    _run(["bash", str(BINDER / "postBuild")], env, REPO, timeout=600)

    # Run the notebook as Binder's kernel would, measuring the memory of everything it starts.
    out = tmp_path / "out.ipynb"
    runner = subprocess.Popen(
        [py, "-c", RUN_NOTEBOOK, str(NOTEBOOK), str(out)],
        env=dict(env, DISTLAB_QUIZ_PROGRESS=str(tmp_path / "quiz"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt")),
        cwd=NOTEBOOK.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    peak = _PeakMemory(runner.pid)
    try:
        log, _ = runner.communicate(timeout=600)
    finally:
        peak.stop()
        if runner.poll() is None:
            runner.kill()
    assert runner.returncode == 0, log

    cells = [c for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code"]

    def text_of(needle: str) -> str:
        cell = next(c for c in cells if needle in "".join(c["source"]))
        return "".join("".join(o.get("text", "")) + "".join(o.get("traceback", [])) for o in cell["outputs"])

    assert "[rank 1] hello from rank 1 of 2" in text_of("hello from rank")
    training = next(c for c in cells if "distlab.watch(" in "".join(c["source"]))
    # The dashboard's last state, as the saved notebook keeps it: its picture, no widget.
    assert any("image/png" in o.get("data", {}) for o in training["outputs"]), training["outputs"]
    assert "rank 1 read a corrupt shard" in text_of("corrupt shard")
    assert "lab stopped" in text_of("%dist stop")
    print(f"peak memory (PSS) of the notebook's processes: {peak.bytes / 1e6:.0f} MB in {peak.processes} processes")
    assert peak.processes >= 4  # kernel, controller, 2 ranks: the measurement saw them
    assert peak.bytes < MEMORY_BUDGET_BYTES, f"{peak.bytes / 1e6:.0f} MB"


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> None:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


class _PeakMemory:
    """Samples the proportional set size (shared pages counted once overall) of a process tree."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.bytes = 0
        self.processes = 0
        self._root = psutil.Process(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(every_s,), daemon=True)
        self._thread.start()

    def _loop(self, every_s: float) -> None:
        while not self._done.wait(every_s):
            try:
                procs = [self._root, *self._root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            if total > self.bytes:
                self.bytes, self.processes = total, len(procs)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)


# Runs in the new environment: execute the notebook with nbclient (cells tagged raises-exception
# may fail, any other failure fails the run) and save it with its outputs.
RUN_NOTEBOOK = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=300, kernel_name="python3").execute()
nbformat.write(nb, sys.argv[2])
"""
