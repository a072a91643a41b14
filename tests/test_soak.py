"""Soak and security: many cells and many start / stop cycles in one kernel leave nothing behind;
what distlab opens listens on loopback, with private, signed connections."""

from __future__ import annotations

import gc
import glob
import json
import os
import stat
import tracemalloc

import psutil
import pytest
from conftest import distlab_processes, rank_lines

CYCLES = 20
CELLS_PER_CYCLE = 10  # 200 %%ddp cells in all
# What 20 cycles may leave alive in the kernel's Python heap: IPython's own input history and the
# cells' source kept for tracebacks (a few hundred bytes a cell), and caches filled once. A leak of a
# lab's client, store or history (tens of kB and more each) would pass it within a few cycles.
LEFT_ALIVE_BYTES = 2 * 2**20


def _footprint() -> tuple[int, set[int]]:
    return psutil.Process().num_fds(), {p.pid for p in distlab_processes()}


def _allreduce_lines(out: str) -> list[str]:
    """The lines the soak's cells print about their all-reduce, rank by rank (a line both printed
    shows once, folded); a start line's "in 2.0 s" is not one."""
    return sorted(line for line in rank_lines(out) if ": all-reduce gave " in line)


def test_the_soak_counts_the_lines_its_cells_print_not_a_number_other_lines_hold():
    out = "2 ranks ready on gloo in 2.0 s (launcher local)\n[rank 0] cell 0: all-reduce gave 2.0\n"
    assert _allreduce_lines(out) == ["[rank 0] cell 0: all-reduce gave 2.0"]


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_two_hundred_cells_and_twenty_start_stop_cycles_leak_no_process_descriptor_or_memory(ipython, capsys):
    def cycle(cells: int) -> None:
        ipython.run_line_magic("dist", "start -n 2")
        for i in range(cells):
            code = f"%%ddp\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('cell {i}: all-reduce gave', t.item())\n"
            result = ipython.run_cell(code)
            assert result.success, result.error_in_exec
        ipython.run_line_magic("dist", "stop")
        out = capsys.readouterr().out
        expected = sorted(f"[rank {r}] cell {i}: all-reduce gave 2.0" for r in (0, 1) for i in range(cells))
        assert _allreduce_lines(out) == expected, out[-500:]

    cycle(CELLS_PER_CYCLE)  # warm-up: imports, caches and pools that are made once
    fds_before, procs_before = _footprint()
    # The Python objects the cycles leave alive, counted by tracemalloc from here: unlike the
    # process's RSS, the count does not move with the allocator's arenas, which threads make or
    # reuse as the scheduler happens to run them (on a busy machine RSS moved by more than 10%).
    tracemalloc.start()
    try:
        for _ in range(CYCLES):
            cycle(CELLS_PER_CYCLE)
        gc.collect()
        left_alive, _peak = tracemalloc.get_traced_memory()
        biggest = tracemalloc.take_snapshot().statistics("lineno")[:5]
    finally:
        tracemalloc.stop()
    fds_after, procs_after = _footprint()
    assert procs_after <= procs_before, f"left running: {procs_after - procs_before}"
    assert fds_after <= fds_before, f"file descriptors {fds_before} -> {fds_after}"
    assert left_alive < LEFT_ALIVE_BYTES, (
        f"{CYCLES} cycles left {left_alive / 2**20:.1f} MiB alive; the most from: " + "; ".join(map(str, biggest))
    )


@pytest.mark.cluster
def test_everything_listens_on_loopback_with_private_signed_connection_files(lab):
    me = psutil.Process()
    processes = list(me.children(recursive=True)) + [psutil.Process(row.pid) for row in lab.status()]
    listening = [
        (p.pid, c.laddr)
        for p in {p.pid: p for p in processes}.values()
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening, "expected the controller and the ranks to listen somewhere"
    assert all(addr.ip in ("127.0.0.1", "::1") for _, addr in listening), listening
    cluster = lab.processes.cluster
    files = glob.glob(os.path.join(cluster.profile_dir, "security", f"ipcontroller-{cluster.cluster_id}-*.json"))
    assert len(files) == 2  # the client's and the engines'
    for path in files:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        with open(path) as file:
            info = json.load(file)
        assert info["signature_scheme"].startswith("hmac-") and len(info["key"]) >= 32
        assert info["interface"] == "tcp://127.0.0.1"
