"""The side panel's back end and install, on a real JupyterLab server with real kernels and labs:
the extension is installed and OK, /distlab/labs refuses strangers, lists the lab of a notebook's
kernel with its ranks and training rate, follows a killed rank and a stop, and forgets dead kernels.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from _jupyter import JupyterLab, execute, wait_for

BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _jupyter(*args: str) -> str:
    done = subprocess.run(
        [str(BIN / "jupyter"), *args], capture_output=True, text=True, timeout=120, check=True
    )
    return ANSI.sub("", done.stdout + done.stderr)


def test_labextension_is_installed_enabled_and_ok() -> None:
    listed = _jupyter("labextension", "list")
    assert re.search(r"^\s*distlab v\S+ enabled OK", listed, re.MULTILINE), listed
    package = json.loads(Path(sys.prefix, "share/jupyter/labextensions/distlab/package.json").read_text())
    assert package["jupyterlab"]["_build"]["load"].startswith("static/remoteEntry.")


def test_server_extension_is_enabled() -> None:
    listed = _jupyter("server", "extension", "list")
    assert re.search(r"distlab\._server\s+enabled", listed), listed
    assert re.search(r"distlab\._server\s+OK", listed), listed


@pytest.fixture
def jupyter(tmp_path: Path) -> Iterator[JupyterLab]:
    """A JupyterLab server of this environment, on a free port with a token; always stopped."""
    root = tmp_path / "notebooks"
    root.mkdir()
    server = JupyterLab(root, tmp_path / "jupyter")
    with server:
        yield server


def test_labs_endpoint_refuses_requests_without_a_valid_token(jupyter: JupyterLab) -> None:
    assert jupyter.request("GET", "/distlab/labs", token=None)[0] == 403
    assert jupyter.request("GET", "/distlab/labs", token="not-the-token")[0] == 403
    assert jupyter.request("GET", "/distlab/labs") == (200, {"labs": []})


@pytest.mark.cluster
def test_labs_endpoint_follows_a_notebooks_lab_from_start_to_stop(jupyter: JupyterLab) -> None:
    session = jupyter.new_session("train.ipynb")
    kernel_id = session["kernel"]["id"]
    client = jupyter.kernel_client(kernel_id)
    try:
        execute(client, "%load_ext distlab\n%dist start -n 2")
        (lab,) = jupyter.labs()
        assert (lab["kernel_id"], lab["notebook"], lab["world_size"], lab["backend"]) == (
            kernel_id, "train.ipynb", 2, "gloo"
        )
        assert [r["rank"] for r in lab["ranks"]] == [0, 1]
        assert {r["health"] for r in lab["ranks"]} == {"ok"}
        assert all(psutil.pid_exists(r["pid"]) for r in lab["ranks"])
        assert lab["training"] == {"step": None, "steps_per_s": None, "allreduce_s": None}
        registry = jupyter.runtime_dir / "distlab" / f"{lab['id']}.json"
        assert registry.stat().st_mode & 0o777 == 0o600

        execute(client, TRAIN)
        (lab,) = jupyter.labs()
        training = lab["training"]
        assert training["step"] == 29
        assert 1 < training["steps_per_s"] < 10_000
        assert 0 < training["allreduce_s"] < 1
        assert lab["busy"] is False

        execute(client, "%dist kill 1")
        (lab,) = jupyter.labs()
        assert [r["health"] for r in lab["ranks"]] == ["ok", "dead"]

        execute(client, "%dist stop")
        assert jupyter.labs() == []
        assert not registry.exists()
    finally:
        client.stop_channels()


TRAIN = """\
%%ddp
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with distlab.watch(model):                # its last publish, on leaving, carries every step
    for step in range(30):
        opt.zero_grad()
        model(torch.randn(32, 64)).pow(2).mean().backward()
        opt.step()
"""


@pytest.mark.cluster
def test_a_killed_kernels_lab_is_dropped_and_its_file_removed(jupyter: JupyterLab) -> None:
    session = jupyter.new_session("crash.ipynb")
    client = jupyter.kernel_client(session["kernel"]["id"])
    try:
        execute(client, "%load_ext distlab\n%dist start -n 2")
        (lab,) = jupyter.labs()
    finally:
        client.stop_channels()
    registry = jupyter.runtime_dir / "distlab" / f"{lab['id']}.json"
    os.kill(lab["pid"], signal.SIGKILL)  # the kernel cannot clean up after itself
    wait_for(lambda: not psutil.pid_exists(lab["pid"]) or psutil.Process(lab["pid"]).status() == "zombie",
             10, "the kernel to die")
    assert jupyter.labs() == []
    assert not registry.exists()
    # Its ranks go too (distlab's reaper), so nothing is left running.
    wait_for(lambda: not any(psutil.pid_exists(r["pid"]) for r in lab["ranks"]), 15, "the ranks to end")


def test_jupyterlab_browser_check_passes_with_the_extension(tmp_path: Path) -> None:
    from _browser import chromium_or_skip

    chromium_or_skip()
    env = dict(
        os.environ,
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "_browser_check.py"), "--ServerApp.allow_root=True",
         f"--ServerApp.root_dir={tmp_path}"],
        check=False, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "browser check: JupyterLab started in chromium with distlab's panel and no errors" in log
    assert "distlab" in log  # the server extension was loaded by the app under test


def test_training_summary_is_rank_0s_recent_rate_and_the_latest_all_reduce() -> None:
    from distlab._registry import training_summary

    def rec(rank: int, step: int, t: float, seconds: list[float]) -> dict[str, object]:
        return {"rank": rank, "step": step, "t": t, "step_time_s": 0.05,
                "allreduce": [{"seconds": s} for s in seconds]}

    # Rank 0: 20 steps 0.1 s apart (the last 10 make the rate); rank 1 slower at the last step.
    records = [rec(0, s, 100 + 0.1 * s, [0.001, 0.002]) for s in range(20)]
    records += [rec(1, 19, 102.0, [0.003, 0.004])]
    summary = training_summary(records)
    assert summary["step"] == 19
    assert summary["steps_per_s"] == pytest.approx(10.0)
    assert summary["allreduce_s"] == pytest.approx((0.003 + 0.007) / 2)  # both ranks' step 19
    one = training_summary([rec(0, 0, 5.0, [])])
    assert one["steps_per_s"] == pytest.approx(20.0) and one["allreduce_s"] is None
    assert training_summary([]) == {"step": None, "steps_per_s": None, "allreduce_s": None}
