"""A real Jupyter kernel with a lab running: shutdown, restart or a hard kill leave nothing behind."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import time

import psutil
import pytest
from _jupyter import execute
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.cluster


def _lab_processes(kernel_pid: int) -> list[psutil.Process]:
    # Everything the kernel started: controller, engines (own sessions), nannies, reaper.
    return psutil.Process(kernel_pid).children(recursive=True)


def _wait_gone(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=seconds)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _release_folders() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "distlab-release-*")))


def _start_kernel_with_lab():
    km, kc = start_new_kernel(kernel_name="python3")
    before = _release_folders()
    execute(kc, "%load_ext distlab\n%dist start -n 2", timeout=60)
    folders = _release_folders() - before
    assert len(folders) == 1, folders  # the lab's release sockets
    pid = km.provisioner.process.pid
    procs = _lab_processes(pid)
    shown = execute(kc, "print(','.join(str(r.pid) for r in get_ipython().run_line_magic('dist', 'status')))")
    engine_pids = [int(p) for p in shown.split(",")]
    assert set(engine_pids) <= {p.pid for p in procs}
    assert len(procs) >= 4, [p.cmdline() for p in procs]
    return km, kc, procs, folders


@pytest.mark.parametrize("how", ["shutdown", "restart", "sigkill"])
def test_no_distlab_process_outlives_its_kernel(how):
    km, kc, procs, folders = _start_kernel_with_lab()
    try:
        if how == "shutdown":
            kc.stop_channels()
            km.shutdown_kernel(now=False)
        elif how == "restart":
            km.restart_kernel(now=False)
        else:
            os.kill(km.provisioner.process.pid, signal.SIGKILL)
        alive = _wait_gone(procs, 5.0)
        assert not alive, f"{how}: still running: {[p.cmdline()[:3] for p in alive]}"
        deadline = time.monotonic() + 5.0  # the reaper removes them just after the processes
        while any(os.path.exists(f) for f in folders) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(os.path.exists(f) for f in folders), f"{how}: left behind: {folders}"
    finally:
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if km.is_alive():
            kc.stop_channels()
            km.shutdown_kernel(now=True)
