"""Soak and security: many cells and many start / stop cycles in one kernel leave nothing behind;
what distlab opens listens on loopback, with private, signed connections."""

from __future__ import annotations

import glob
import json
import os
import stat

import psutil
import pytest

from conftest import distlab_processes

CYCLES = 20
CELLS_PER_CYCLE = 10  # 200 %%ddp cells in all


def _footprint() -> tuple[int, int, set[int]]:
    me = psutil.Process()
    return me.num_fds(), me.memory_info().rss, {p.pid for p in distlab_processes()}


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_two_hundred_cells_and_twenty_start_stop_cycles_leak_no_process_descriptor_or_memory(ipython, capsys):
    def cycle(cells: int) -> None:
        ipython.run_line_magic("dist", "start -n 2")
        for i in range(cells):
            result = ipython.run_cell(f"%%ddp\nt = torch.ones(1)\ndist.all_reduce(t)\nprint({i}, t.item())\n")
            assert result.success, result.error_in_exec
        ipython.run_line_magic("dist", "stop")
        out = capsys.readouterr().out
        assert out.count("2.0") == 2 * cells, out[-500:]

    cycle(CELLS_PER_CYCLE)  # warm-up: imports, caches and pools that are made once
    fds_before, rss_before, procs_before = _footprint()
    for _ in range(CYCLES):
        cycle(CELLS_PER_CYCLE)
    fds_after, rss_after, procs_after = _footprint()
    assert procs_after <= procs_before, f"left running: {procs_after - procs_before}"
    assert fds_after <= fds_before, f"file descriptors {fds_before} -> {fds_after}"
    assert rss_after < 1.10 * rss_before, f"memory {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"


@pytest.mark.cluster
def test_everything_listens_on_loopback_with_private_signed_connection_files(lab):
    me = psutil.Process()
    processes = [p for p in me.children(recursive=True)] + [psutil.Process(row.pid) for row in lab.status()]
    listening = [
        (p.pid, c.laddr)
        for p in {p.pid: p for p in processes}.values()
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening, "expected the controller and the ranks to listen somewhere"
    assert all(addr.ip in ("127.0.0.1", "::1") for _, addr in listening), listening
    cluster = lab._cluster
    files = glob.glob(os.path.join(cluster.profile_dir, "security", f"ipcontroller-{cluster.cluster_id}-*.json"))
    assert len(files) == 2  # the client's and the engines'
    for path in files:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        info = json.load(open(path))
        assert info["signature_scheme"].startswith("hmac-") and len(info["key"]) >= 32
        assert info["interface"] == "tcp://127.0.0.1"
