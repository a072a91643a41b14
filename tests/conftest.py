"""Fixtures that start real clusters and always stop what they started."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

import distlab
from distlab.notebook.lab import Lab

# Open MPI refuses to run as root unless told it may (CI containers run as root).
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


@pytest.fixture(autouse=True)
def _quiz_progress_in_tmp(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test writes quiz progress into the real Jupyter data directory."""
    monkeypatch.setenv("DISTLAB_QUIZ_PROGRESS", str(tmp_path))


@pytest.fixture
def lab_factory(request: pytest.FixtureRequest) -> Callable[..., Lab]:
    """Start labs on demand; every lab started is stopped when the test ends, pass or fail."""

    def make(**kwargs: object) -> Lab:
        lab = Lab(**kwargs)  # type: ignore[arg-type]
        request.addfinalizer(lab.stop)
        return lab.start()

    return make


@pytest.fixture(scope="session")
def _shared_lab() -> Iterator[Lab]:
    shared = distlab.start(ranks=2, timeout=20)
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
def lab(_shared_lab: Lab) -> Lab:
    """One 2-rank gloo lab shared by tests that leave it as they found it.

    A test that failed half-way may leave a rank dead or the group broken: the next test gets a
    fresh world instead of failing for the same cause.
    """
    if _shared_lab.world_size != 2 or any(row.health != "ok" for row in _shared_lab.status()):
        _shared_lab.restart(ranks=2)
    return _shared_lab


@pytest.fixture
def ipython() -> Iterator[object]:
    """A real IPython shell with the extension loaded; its lab is stopped afterwards."""
    from IPython.testing.globalipapp import get_ipython, start_ipython

    ip = start_ipython() or get_ipython()  # the global shell is created once per session
    ip.run_line_magic("load_ext", "distlab")
    magics = distlab.notebook.magics._registered[id(ip)]
    try:
        yield ip
    finally:
        if magics.lab is not None:
            magics.lab.stop()
        magics.lab = None
        ip.run_line_magic("unload_ext", "distlab")


# Processes this test run starts inherit this mark, orphans included: other labs on the same machine
# (another test run, a notebook) are not ours to count.
_OWNER = f"{os.getpid()}-{time.time_ns()}"
os.environ["DISTLAB_TEST_RUN"] = _OWNER


def _ours(proc: psutil.Process) -> bool:
    try:
        return proc.environ().get("DISTLAB_TEST_RUN") == _OWNER
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def distlab_processes() -> list[psutil.Process]:
    """Every live ipyparallel engine/controller or distlab reaper process this test run started."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(k in cmd for k in ("ipyparallel.engine", "ipyparallel.controller", "distlab.cluster.reaper",
                                   "ipengine", "ipcontroller")) and _ours(proc):
            found.append(proc)
    return found
