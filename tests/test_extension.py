"""The side panel's back end and install, on a real JupyterLab server with real kernels and labs:
the extension is installed and OK, /distlab/labs refuses strangers, lists the lab of a notebook's
kernel with its ranks and training rate, follows a killed rank and a stop, and forgets dead kernels;
POST /distlab/labs/<id>/<action> stops and restarts a lab however its kernel started it, and answers
a wrong request with one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

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


@pytest.mark.cluster
def test_labextension_is_installed_enabled_and_ok() -> None:
    listed = _jupyter("labextension", "list")
    assert re.search(r"^\s*distlab v\S+ enabled OK", listed, re.MULTILINE), listed
    package = json.loads(Path(sys.prefix, "share/jupyter/labextensions/distlab/package.json").read_text())
    assert package["jupyterlab"]["_build"]["load"].startswith("static/remoteEntry.")


@pytest.mark.cluster
def test_server_extension_is_enabled() -> None:
    listed = _jupyter("server", "extension", "list")
    assert re.search(r"distlab\.server\s+enabled", listed), listed
    assert re.search(r"distlab\.server\s+OK", listed), listed


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
    assert jupyter.request("GET", "/distlab/labs") == (200, {"labs": [], "kept": []})
    assert jupyter.request("POST", "/distlab/labs/lab-1-a/stop", token=None)[0] == 403
    assert jupyter.request("POST", "/distlab/labs/lab-1-a/stop", token="not-the-token")[0] == 403


# A stop or restart answers once it is done: a restart starts new engines, which on a loaded machine
# can take longer than the 30 s that JupyterLab.request waits.
ACTION_DEADLINE_S = 300


def _post(jupyter: JupyterLab, path: str) -> tuple[int, Any]:
    """(status, parsed JSON or text) of an authenticated POST, waiting up to ACTION_DEADLINE_S."""
    req = urllib.request.Request(
        jupyter.url + path, data=b"", method="POST", headers={"Authorization": f"token {jupyter.token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=ACTION_DEADLINE_S) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _one_line(body: Any) -> str:
    """The error's message, which must be one line."""
    assert isinstance(body, dict), body
    message = body["message"]
    assert message and "\n" not in message, body
    return str(message)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_action_on_an_unknown_lab_or_an_unknown_action_is_refused_in_one_line(jupyter: JupyterLab) -> None:
    status, body = _post(jupyter, "/distlab/labs/lab-1-abc/stop")
    assert status == 404 and "no running lab 'lab-1-abc'" in _one_line(body), (status, body)
    status, body = _post(jupyter, "/distlab/labs/lab-1-abc/explode")
    assert status == 400 and "unknown action 'explode'" in _one_line(body), (status, body)
    assert "stop or restart" in body["message"]


@pytest.mark.cluster
def test_the_panels_restart_and_stop_reach_a_lab_started_with_distlab_start_in_a_kernel(
    jupyter: JupyterLab,
) -> None:
    session = jupyter.new_session("no-magics.ipynb")
    client = jupyter.kernel_client(session["kernel"]["id"])
    try:
        execute(client, "import distlab\nlab = distlab.start(ranks=2)")  # no %load_ext, no %dist
        (lab,) = jupyter.labs()
        first = [r["pid"] for r in lab["ranks"]]
        assert all(_alive(pid) for pid in first)

        # A wrong action changes nothing.
        status, body = _post(jupyter, f"/distlab/labs/{lab['id']}/explode")
        assert status == 400, body
        assert [r["pid"] for r in jupyter.labs()[0]["ranks"]] == first

        status, body = _post(jupyter, f"/distlab/labs/{lab['id']}/restart")
        assert status == 200, body
        assert body["id"] == lab["id"] and body["kernel_id"] == lab["kernel_id"], body
        assert re.fullmatch(r"2 fresh ranks ready in \d+\.\d s", body["message"]), body
        (restarted,) = jupyter.labs()
        assert restarted["id"] == lab["id"]
        second = [r["pid"] for r in restarted["ranks"]]
        assert len(second) == 2 and not set(second) & set(first), (first, second)
        assert all(_alive(pid) for pid in second)
        wait_for(lambda: not any(_alive(pid) for pid in first), 30, "the first engines to exit")
        assert execute(client, "print(lab.running, lab.world_size)") == "True 2\n"

        status, body = _post(jupyter, f"/distlab/labs/{lab['id']}/stop")
        assert status == 200, body
        assert body["message"] == "lab stopped: engines and controller are gone"
        assert jupyter.labs() == []
        wait_for(lambda: not any(_alive(pid) for pid in second), 30, "the stopped engines to exit")
        assert execute(client, "print(lab.running)") == "False\n"

        # Stopped, it is no longer there to act on.
        status, body = _post(jupyter, f"/distlab/labs/{lab['id']}/restart")
        assert status == 404 and lab["id"] in _one_line(body), body
    finally:
        client.stop_channels()


SCRIPT_LAB = """\
import sys, distlab
lab = distlab.start(ranks=1)
sys.stdin.read()  # until the test closes our stdin
lab.stop()
"""


@pytest.mark.cluster
def test_a_lab_outside_this_servers_kernels_is_refused_in_one_line_and_left_running(
    jupyter: JupyterLab,
) -> None:
    script = subprocess.Popen(
        [sys.executable, "-c", SCRIPT_LAB], env=jupyter.env, stdin=subprocess.PIPE, text=True
    )
    try:
        files = jupyter.runtime_dir / "distlab"
        state = wait_for(lambda: list(files.glob(f"lab-{script.pid}-*.json")), 120, "the script's lab")[0]
        (rank,) = json.loads(state.read_text())["ranks"]
        assert jupyter.labs() == []  # not this server's to list

        status, body = _post(jupyter, f"/distlab/labs/{state.stem}/stop")
        assert status == 404, body
        assert f"runs in process {script.pid}, which is not a kernel of this server" in _one_line(body)
        status, body = jupyter.request("GET", f"/distlab/labs/{state.stem}/stacks")
        assert status == 404, body
        assert _one_line(body).endswith("(a script, or another server's kernel): read its stacks there")
        assert _alive(rank["pid"]) and state.exists()

        script.communicate(input="", timeout=60)  # the script stops its lab and exits
        assert script.returncode == 0
        wait_for(lambda: not _alive(rank["pid"]), 30, "the script's engine to exit")
    finally:
        if script.poll() is None:  # the reaper ends its lab's engines with it
            script.kill()
            script.wait(timeout=30)


@contextlib.asynccontextmanager
async def _kernel_with_lab(connection_dir: Path, ranks: int) -> AsyncIterator[tuple[Any, str, Any, dict[str, Any]]]:
    """A kernel of jupyter_server's own kernel manager, with ``lab = distlab.start(ranks=...)`` run
    in it: (the kernel manager, the kernel's id, its client, the lab's state file as the server reads it)."""
    from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager

    from distlab.server.registry import read_labs

    kernels = AsyncMappingKernelManager(connection_dir=str(connection_dir))
    kernel_id = await kernels.start_kernel(kernel_name="python3")
    client = kernels.get_kernel(kernel_id).client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=120)
        started = await client.execute(f"import distlab\nlab = distlab.start(ranks={ranks})", reply=True, timeout=180)
        assert started["content"]["status"] == "ok", started["content"]
        (lab,) = read_labs()
        yield kernels, kernel_id, client, lab
    finally:
        client.stop_channels()
        await kernels.shutdown_all(now=True)


async def _until(condition: Any, seconds: float, what: str) -> None:
    for _ in range(int(seconds / 0.2)):
        if condition():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {seconds:g} s waiting for {what}")


@pytest.mark.cluster
def test_an_action_behind_a_running_cell_answers_at_its_deadline_and_runs_when_the_cell_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """act_on_lab (what the POST handler calls), on a kernel of jupyter_server's own kernel manager."""
    from distlab.server.handlers import LabActionError, act_on_lab
    from distlab.server.registry import read_labs

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))  # the kernel's labs write here, we read here

    async def scenario() -> None:
        async with _kernel_with_lab(tmp_path, ranks=1) as (kernels, kernel_id, client, lab):
            (rank,) = lab["ranks"]
            # A long cell, which must not drop what queues behind it when interrupted.
            cell = client.execute("import time\ntime.sleep(300)", stop_on_error=False)
            while True:  # the kernel has started the cell
                msg = await client.get_iopub_msg(timeout=60)
                if msg["parent_header"].get("msg_id") == cell and msg["msg_type"] == "execute_input":
                    break

            with pytest.raises(LabActionError) as late:
                await act_on_lab(kernels, lab["id"], "stop", timeout=2)
            assert late.value.status == 504
            assert late.value.message == (
                f"kernel {kernel_id} did not answer within 2 s (is a cell still running there?); "
                "the stop stays queued in it and runs when the kernel gets to it"
            )
            assert _alive(rank["pid"]) and [x["id"] for x in read_labs()] == [lab["id"]]

            await kernels.interrupt_kernel(kernel_id)  # the cell ends; the queued stop runs
            await _until(lambda: read_labs() == [], 120, "the queued stop to stop the lab")
            await _until(lambda: not _alive(rank["pid"]), 30, "the lab's engine to exit")

    asyncio.run(scenario())


@pytest.mark.cluster
def test_the_stacks_of_a_lab_whose_kernel_runs_a_cell_are_read_by_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stacks_of_lab (what GET /distlab/labs/<id>/stacks calls) while the lab's kernel is busy with a
    cell on the ranks: the kernel is not asked, the ranks are read from outside."""
    from distlab.server.handlers import LabActionError, stacks_of_lab

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))

    async def scenario() -> None:
        async with _kernel_with_lab(tmp_path, ranks=2) as (kernels, _, client, lab):
            client.execute('lab.run("import time\\ndef waiting_here():\\n    time.sleep(300)\\nwaiting_here()")')
            for _ in range(300):  # until both ranks are in the cell's function (60 s or more)
                taken = await stacks_of_lab(kernels, lab["id"])
                # Both: under load one rank reaches it a moment before the other (their stacks differ then).
                if "waiting_here" in taken["text"] and taken["text"].startswith("ranks 0-1"):
                    break
                await asyncio.sleep(0.2)
            assert taken["text"].splitlines() == [
                "ranks 0-1 (MainThread), most recent call last:",
                "    <module> (<cell>:4)",
                "    waiting_here (<cell>:3)",
            ], taken
            assert taken["missing"] == {} and taken["id"] == lab["id"]
            with pytest.raises(LabActionError) as unknown:
                await stacks_of_lab(kernels, "lab-1-abc")
            assert unknown.value.status == 404 and "no running lab 'lab-1-abc'" in unknown.value.message

    asyncio.run(scenario())


def test_registry_act_names_an_unknown_lab_or_action_in_one_line_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distlab.server import registry

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(LookupError) as unknown_lab:
        registry.act("lab-1-abc", "stop")
    message = str(unknown_lab.value)
    assert message.startswith(f"no running lab 'lab-1-abc' in process {os.getpid()}") and "\n" not in message
    with pytest.raises(ValueError, match=r"^unknown action 'explode' for a lab: use one of stop, restart, step, "
                                         r"continue$"):
        registry.act("lab-1-abc", "explode")
    assert list(tmp_path.iterdir()) == []  # no state file written


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


@pytest.mark.e2e
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
    from distlab.server.registry import training_summary

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
