"""Fixtures that start real clusters and always stop what they started; the test tiers.

Tiers, as marks (``make test-fast``, ``make test-cluster``, ``make test-e2e``; ``make test`` runs all):
- fast (no mark): starts no process; a test there that starts one fails, naming the mark to add.
- ``cluster``: starts processes: ipyparallel clusters and process groups, Jupyter kernels and
  servers, Open MPI. Tests using the fixtures below that start them get the mark by themselves.
- ``e2e``: the slow end-to-end runs: the notebooks (nbval), the browser, Binder, the soak.
- ``gpu`` (with ``cluster``): ranks on a real NVIDIA GPU; skipped, saying why, where there is none.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

import distlab
from distlab.cluster.gpus import local_gpus
from distlab.front.lab import Lab

# Everything this run and the processes it starts put in the temporary folder (kernels' connection
# files, pytest's tmp_path, torch's compile cache, torchrun's logs, Open MPI's session folders)
# goes into one folder of its own, removed when the run ends: the suite leaves nothing in /tmp.
_SUITE_TMP = tempfile.mkdtemp(prefix="distlab-suite-")
os.environ["TMPDIR"] = tempfile.tempdir = _SUITE_TMP
atexit.register(shutil.rmtree, _SUITE_TMP, ignore_errors=True)
# Open MPI refuses to run as root unless told it may (CI containers run as root).
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
# Kernels this run starts (nbval's included) keep their quiz progress out of the user's Jupyter data.
if "DISTLAB_QUIZ_PROGRESS" not in os.environ:
    os.environ["DISTLAB_QUIZ_PROGRESS"] = tempfile.mkdtemp(prefix="distlab-test-quiz-")
    atexit.register(shutil.rmtree, os.environ["DISTLAB_QUIZ_PROGRESS"], ignore_errors=True)

# Fixtures that start processes: a test using one is in the cluster tier.
_PROCESS_FIXTURES = {"lab", "_shared_lab", "_learners_lab", "lab_factory", "ipython", "jupyter"}
# Test modules that are end-to-end runs as a whole.
_E2E_MODULES = {"test_browser.py", "test_browser_ranks.py", "test_binder.py", "test_soak.py"}


def pytest_sessionstart(session: pytest.Session) -> None:
    # matplotlib lists the machine's fonts the first time it is imported (running fc-list) and keeps
    # the list in its cache: done here, once, a fast-tier test that draws a picture on a fresh
    # machine starts no process.
    import matplotlib.font_manager  # noqa: F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = local_gpus()
    for item in items:
        if item.get_closest_marker("gpu") and not gpus:
            item.add_marker(pytest.mark.skip(reason=(
                "no GPU: NVIDIA's driver shows none on this machine; run on one with scripts/gpu-check.sh"
                if gpus == 0 else "GPUs unknown without NVIDIA's driver (ROCm?): the gpu tests need CUDA"
            )))
        if item.path.suffix == ".ipynb" or item.path.name in _E2E_MODULES:
            item.add_marker(pytest.mark.e2e)
        if _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
    # The longest files first, so that two workers (make test: pytest-xdist, a file to a worker, in
    # this order) finish together instead of one running Binder's install alone at the end. Files
    # stay whole and in their order within each tier; a sort is stable.
    tier: dict[object, int] = {}
    for item in items:
        rank = 0 if item.get_closest_marker("e2e") else 1 if item.get_closest_marker("cluster") else 2
        tier[item.path] = min(tier.get(item.path, rank), rank)
    items.sort(key=lambda item: tier[item.path])


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test in the fast tier that starts a process fails at once, saying which mark it needs."""
    if request.node.get_closest_marker("cluster") or request.node.get_closest_marker("e2e"):
        return

    def refuse(self: object, args: object, *rest: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{request.node.nodeid} started a process ({args!r}): mark it @pytest.mark.cluster, "
            "or keep it in the fast tier by not starting one"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture(autouse=True)
def _quiz_progress_in_tmp(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test writes quiz progress into the real Jupyter data directory."""
    monkeypatch.setenv("DISTLAB_QUIZ_PROGRESS", str(tmp_path))


def rank_lines(out: str) -> list[str]:
    """Streamed output with each folded line (``[ranks 0-1] x``, printed alike by those ranks) given
    back to each rank (``[rank 0] x``, ``[rank 1] x``): for tests about what each rank printed."""
    from distlab.errors import parse_ranks

    lines = []
    for line in out.splitlines():
        folded = re.match(r"\[ranks ([\d,-]+)\] (.*)", line)
        if folded is None:
            lines.append(line)
            continue
        ranks = parse_ranks(folded.group(1), 1 + max(int(n) for n in re.findall(r"\d+", folded.group(1))))
        lines.extend(f"[rank {r}] {folded.group(2)}" for r in ranks)
    return lines


def python_lines(code: str, timeout_s: float) -> list[str]:
    """What a fresh Python process (a notebook's, with nothing imported yet) running ``code`` printed.

    It must exit cleanly within ``timeout_s``; if not, the assertion shows the end of what it said.
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


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


def whole(shared: Lab) -> Lab:
    """``shared``, a 2-rank lab kept across tests, with 2 healthy ranks again if it lost them.

    A test that failed half-way may leave a rank dead or the group broken: the next test gets a
    fresh world instead of failing for the same cause.
    """
    if shared.world_size != 2 or any(row.health != "ok" for row in shared.status()):
        shared.restart(ranks=2)
    return shared


@pytest.fixture
def lab(_shared_lab: Lab) -> Lab:
    """One 2-rank gloo lab shared by tests that leave it as they found it."""
    return whole(_shared_lab)


@pytest.fixture(scope="session")
def _learners_lab() -> Iterator[Lab]:
    """The learner's 2-rank lab the exercise tests share (tests/_exercises.py), apart from ``lab``:
    the grader's labs it keeps (one per world size) live as long as it does."""
    shared = distlab.start(ranks=2)
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
def ipython() -> Iterator[object]:
    """A real IPython shell with the extension loaded; its lab is stopped afterwards."""
    from IPython.testing.globalipapp import get_ipython, start_ipython

    ip = start_ipython() or get_ipython()  # the global shell is created once per session
    ip.run_line_magic("load_ext", "distlab")
    magics = distlab.front.magics._registered[id(ip)]
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


def ours(proc: psutil.Process) -> bool:
    """Whether this test run (this pytest process or xdist worker) started ``proc``."""
    try:
        return proc.environ().get("DISTLAB_TEST_RUN") == _OWNER
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def lab_namespaces(pid: int | None = None) -> set[str]:
    """The network namespaces of process ``pid``'s labs (this process's by default): distlab names
    them after it, and other labs on the machine (another xdist worker's, a notebook's) are not ours."""
    prefix = f"distlab-{os.getpid() if pid is None else pid}-"
    try:
        return {n for n in os.listdir("/run/netns") if n.startswith(prefix)}
    except OSError:  # no namespace made on this machine yet
        return set()


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
                                   "distlab.rank.engine_main",
                                   "ipengine", "ipcontroller")) and ours(proc):
            found.append(proc)
    return found


def spawned_since(before: set[int]) -> list[str]:
    """The command lines of the kernels, ipyparallel and distlab processes this test run started that are
    not among the pids ``before``: what a test that ends them expects to see gone."""
    return [
        " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["pid", "cmdline"])
        if p.pid not in before and ours(p)
        and any(k in " ".join(p.info["cmdline"] or []) for k in ("ipyparallel", "distlab", "ipykernel"))
    ]
