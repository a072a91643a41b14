"""A real Jupyter kernel with a lab running: shutdown, restart or a hard kill leave nothing behind."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from _jupyter import execute
from conftest import lab_namespaces
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.cluster


def _lab_processes(kernel_pid: int) -> list[psutil.Process]:
    # Everything the kernel started: controller, engines (own sessions), nannies, reaper.
    return psutil.Process(kernel_pid).children(recursive=True)


def _wait_gone(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=seconds)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _lab_folders() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "distlab-lab-*")))




def _start_kernel_with_lab(line: str):
    km, kc = start_new_kernel(kernel_name="python3")
    pid = km.provisioner.process.pid
    before, namespaces_before = _lab_folders(), lab_namespaces(pid)
    execute(kc, f"%load_ext distlab\n%dist {line}", timeout=90)
    # Everything this kernel's lab made: a folder (the controller's sockets) and namespaces on nodes.
    folders = {f for f in _lab_folders() - before if os.path.basename(f).startswith(f"distlab-lab-{pid}-")}
    namespaces = lab_namespaces(pid) - namespaces_before
    if "--nodes" in line:
        assert len(folders) == 1 and len(namespaces) == 3, (folders, namespaces)  # switch and two nodes
    # ipyparallel's files for the lab's cluster: its logs, connection files, the hub's engine state.
    code = "from distlab import ipycompat; from distlab.notebook import labs\n"
    shown = execute(kc, code + "print(*ipycompat.cluster_files(labs.current().processes.cluster))")
    files = {path for pattern in shown.split() for path in glob.glob(pattern)}
    assert any(os.path.basename(f).startswith("engines") for f in files), files
    procs = _lab_processes(pid)
    shown = execute(kc, "print(','.join(str(r.pid) for r in get_ipython().run_line_magic('dist', 'status')))")
    engine_pids = [int(p) for p in shown.split(",")]
    assert set(engine_pids) <= {p.pid for p in procs}
    assert len(procs) >= 4, [p.cmdline() for p in procs]
    return km, kc, procs, folders | files | {os.path.join("/run/netns", n) for n in namespaces}


@pytest.mark.parametrize(
    "how, line",
    [
        ("shutdown", "start -n 2"),
        ("restart", "start -n 2"),
        ("sigkill", "start -n 2"),
        # Namespaces and links of nodes, torchft's lighthouse and the template's torchft preload:
        # one lab makes them all, so each way of ending a kernel is tried on it once.
        ("shutdown", "start -n 2 --nodes 2 --link 1gbit --heal"),
        ("sigkill", "start -n 2 --nodes 2 --link 1gbit --heal"),
    ],
)
def test_no_distlab_process_or_namespace_outlives_its_kernel(how, line):
    km, kc, procs, folders = _start_kernel_with_lab(line)
    if "--heal" in line:
        assert any("torchftcompat_lighthouse" in " ".join(p.cmdline()) for p in procs)
    try:
        if how == "shutdown":
            kc.stop_channels()
            km.shutdown_kernel(now=False)
        elif how == "restart":
            km.restart_kernel(now=False)
        else:
            os.kill(km.provisioner.process.pid, signal.SIGKILL)
        # A generous deadline, not a bound: the processes are killed at once, but a rank that held torch
        # can take seconds to leave on a loaded machine (CI saw one still exiting, its command line
        # already gone, 5 s after a shutdown); one that was never killed is still there after 30.
        alive = _wait_gone(procs, 30.0)
        assert not alive, f"{how}: still running: {[(p.pid, p.cmdline()[:3]) for p in alive]}"
        deadline = time.monotonic() + 30.0  # the reaper removes them just after the processes
        while any(os.path.exists(f) for f in folders) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = sorted(f for f in folders if os.path.exists(f))
        assert not left, f"{how}: left behind: {left}"
    finally:
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if km.is_alive():
            kc.stop_channels()
            km.shutdown_kernel(now=True)


def test_a_notebook_killed_part_way_through_a_stop_leaves_nothing_behind():
    # A kernel's shutdown runs the stop at exit, and kills the kernel if it outlasts 2.5 s: on a
    # loaded machine that lands anywhere in the stop. Here the process dies after the cluster's
    # processes and files are gone, before the lab's folder and its lighthouse's reaping.
    code = (
        "import os, signal, distlab\n"
                "lab = distlab.Lab(ranks=2, heal=True, timeout=60).start()\n"
        "print(lab.processes.folder, lab.healer.lighthouse.pid, flush=True)\n"
        "lab.healer.stop_lighthouse = lambda: os.kill(os.getpid(), signal.SIGKILL)\n"
        "lab.stop()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    folder, lighthouse = out.stdout.split()
    assert os.path.isdir(os.path.dirname(folder))
    deadline = time.monotonic() + 10.0  # the watchdog polls its parent every 0.2 s
    while (os.path.exists(folder) or psutil.pid_exists(int(lighthouse))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(folder), os.listdir(folder)
    assert not psutil.pid_exists(int(lighthouse)) or psutil.Process(int(lighthouse)).status() == psutil.STATUS_ZOMBIE

