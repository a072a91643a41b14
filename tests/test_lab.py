"""The Lab API against real engines and real torch.distributed process groups."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

import distlab
from distlab.cluster.processes import pid_alive, wait_for
from distlab.errors import CellTimeout, LabUsageError, RankError

pytestmark = pytest.mark.cluster


def test_every_rank_has_its_identity_and_an_initialised_process_group(lab):
    values = lab.run(
        "import os\n(rank, world_size, local_rank, str(device), dist.is_initialized(), dist.get_rank(),"
        " dist.get_backend(), torch.__name__, int(os.environ['MASTER_PORT']))",
        stream=False,
    )
    assert sorted(values) == [0, 1]
    ports = set()
    for r, (rank, world, local, device, up, dist_rank, backend, torch_name, port) in values.items():
        assert (rank, world, local, device, up, dist_rank, backend, torch_name) == (
            r, 2, r, "cpu", True, r, "gloo", "torch"
        )
        ports.add(port)
    assert len(ports) == 1 and ports != {29500}


def test_the_rank_table_maps_ranks_to_live_engine_processes(lab):
    table = lab.status()
    assert [row.rank for row in table] == [0, 1]
    pids = lab.run("import os\nos.getpid()", stream=False)
    for row in table:
        assert row.pid == pids[row.rank]
        assert psutil.Process(row.pid).is_running()
        assert row.health == "ok" and row.backend == "gloo" and row.device == "cpu"
    text = str(table)
    assert text.splitlines()[0].split() == ["rank", "engine_id", "host", "addr", "pid", "device", "backend", "health"]


# Each rank prints a line, then waits for the notebook to answer it: the notebook can only answer a
# line that reached it while the cell still ran, whatever the machine's load. The ranks give up after
# a minute, so a lab that shows output only at a cell's end fails the test instead of hanging it.
_WAIT_FOR_ANSWER = """
import os, time
print('first', rank, flush=True)
give_up = time.monotonic() + 60
while not os.path.exists(ANSWER) and time.monotonic() < give_up:
    time.sleep(0.02)
print('second', rank)
os.path.exists(ANSWER)
"""


def test_output_is_streamed_labelled_by_rank_while_the_cell_runs(lab, capsys, tmp_path):
    answer = tmp_path / "answer"
    lab.push(ANSWER=str(answer))
    seen = ""
    done = threading.Event()

    def watch() -> None:
        nonlocal seen
        while not done.is_set():
            seen += capsys.readouterr().out
            if "[rank 0] first 0" in seen and "[rank 1] first 1" in seen:
                answer.touch()  # both ranks' first lines arrived while they were waiting for it
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        answered = lab.run(_WAIT_FOR_ANSWER)
    finally:
        done.set()
        watcher.join()
    seen += capsys.readouterr().out
    assert dict(answered) == {0: True, 1: True}, f"the first lines reached the notebook only at the end: {seen!r}"
    assert "[rank 0] second 0" in seen and "[rank 1] second 1" in seen, seen


def test_lines_are_prefixed_with_their_rank(lab, capsys):
    for _ in range(5):  # each rank's last line must arrive even when its reply overtakes it
        lab.run("print('a', rank)\nprint('b', rank)")
        lines = capsys.readouterr().out.splitlines()
        assert sorted(lines) == ["[rank 0] a 0", "[rank 0] b 0", "[rank 1] a 1", "[rank 1] b 1"]
    lab.run("print('a', rank)\nprint('b', rank)")
    lines = capsys.readouterr().out.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] a {rank}" in lines and f"[rank {rank}] b {rank}" in lines


def test_a_cell_can_run_on_a_subset_of_ranks(lab):
    assert dict(lab.run("rank * 10", ranks="1", stream=False)) == {1: 10}
    assert dict(lab.run("rank", ranks=[0, 1], stream=False)) == {0: 0, 1: 1}


def test_push_and_pull_move_values_by_rank(lab):
    lab.push(alpha=3, beta=[1, 2])
    assert lab.pull("alpha") == {0: 3, 1: 3}
    lab.run("alpha = alpha * (rank + 1)", stream=False)
    assert lab.pull("alpha") == {0: 3, 1: 6}
    assert lab.pull("beta", ranks="1") == {1: [1, 2]}


def test_functions_defined_in_the_notebook_reach_the_ranks(lab):
    def scale(x):
        return x * 7

    lab.push(scale=scale)
    assert lab.pull("scale") and dict(lab.run("scale(rank)", stream=False)) == {0: 0, 1: 7}


def test_pulling_a_missing_name_names_the_ranks(lab):
    with pytest.raises(RankError) as info:
        lab.pull("never_defined_anywhere")
    assert str(info.value).startswith("ranks 0-1: NameError")


def test_a_failure_on_every_rank_is_reported_once_with_the_ranks_grouped(lab):
    with pytest.raises(RankError) as info:
        lab.run("x = 1\n1 / 0", stream=False)
    err = info.value
    assert str(err).splitlines()[0] == "ranks 0-1: ZeroDivisionError: division by zero"
    assert err.render().count("Traceback") == 1
    assert '<rank 0 cell>", line 2' in err.render()
    assert "bootstrap" not in err.render()  # distlab's own frames are trimmed away
    # a plain error does not break the group: no rebuild, and the group still works
    assert not any("rebuilt" in n for n in err.notes)
    assert dict(lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False)) == {0: 2.0, 1: 2.0}


def test_a_rank_failing_before_a_collective_releases_the_others_and_the_group_is_rebuilt(lab):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        lab.run("if rank == 1:\n    raise ValueError('bad shard')\nt = torch.ones(1)\ndist.all_reduce(t)", stream=False)
    elapsed = time.monotonic() - t0
    # Generous: a rank left to wait out the collective timeout would take lab.timeout.
    assert elapsed < lab.timeout / 2, f"ranks waited {elapsed:.1f} s instead of being released"
    err = info.value
    assert err.failures[1].ename == "ValueError"
    stopped = err.failures[0]
    assert stopped.ename == "Stopped" and "rank 1 failed" in stopped.evalue
    assert "line 4: dist.all_reduce(t)" in stopped.evalue  # where rank 0 was waiting
    assert any("rebuilt" in note for note in err.notes)
    assert dict(lab.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t); t.item()", stream=False)) == {
        0: 3.0,
        1: 3.0,
    }


def test_strict_refuses_a_cell_only_some_ranks_would_reach_a_collective_in_and_runs_nothing(lab):
    cell = "ran_strict = True\nfor _ in range(rank + 1):\n    dist.barrier()\n"
    assert [(f.line, f.message.split(" (")[0]) for f in lab.lint(cell)] == [
        (3, "dist.barrier is in a loop whose count depends on the rank")]
    with pytest.raises(LabUsageError, match=r"^strict: nothing ran, the lint found 1 collective"):
        lab.run(cell, strict=True)
    assert dict(lab.run("'ran_strict' in globals()", stream=False)) == {0: False, 1: False}
    # What a cell leaves on the ranks is known to the lint of the next: a function that all-reduces.
    lab.run("def total(t):\n    dist.all_reduce(t)\n    return t", stream=False)
    assert [f.line for f in lab.lint("if rank == 0:\n    total(torch.ones(1))\n")] == [2]
    assert distlab.lint("if rank == 0:\n    total(torch.ones(1))\n") == []  # a cell alone knows no total


def test_ranks_waiting_on_a_failed_rank_are_released_even_when_a_ddp_model_holds_the_group(lab):
    lab.run("from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "held = DDP(torch.nn.Linear(2, 2))\nkeep_me = 41", stream=False)
    pids = [row.pid for row in lab.status()]
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        lab.run(
            "if rank == 0:\n    raise KeyError('no such batch')\nt = torch.ones(1)\ndist.all_reduce(t)", stream=False
        )
    assert time.monotonic() - t0 < lab.timeout / 2  # released, not left to wait out the timeout
    assert info.value.failures[1].ename == "Stopped"
    assert not any("killed" in note or "restarted" in note for note in info.value.notes)
    assert [row.pid for row in lab.status()] == pids  # same processes: nothing was killed
    assert dict(lab.run("keep_me + 1", stream=False)) == {0: 42, 1: 42}  # namespaces kept
    assert dict(lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False)) == {0: 2.0, 1: 2.0}


def test_a_cell_past_its_deadline_is_stopped_on_every_rank(lab):
    t0 = time.monotonic()
    with pytest.raises(CellTimeout) as info:
        lab.run("import time\ntime.sleep(30)", timeout=1.0, stream=False)
    assert time.monotonic() - t0 < 15  # ended near its 1 s deadline, not with the 30 s sleep
    assert info.value.ranks == [0, 1]
    assert "deadline" in str(info.value)
    assert dict(lab.run("rank", stream=False)) == {0: 0, 1: 1}


def test_interrupting_the_kernel_stops_the_cell_on_every_rank(lab):
    # A kernel interrupt is SIGINT to the notebook's process: KeyboardInterrupt where it waits
    # (ipykernel installs Python's default handler while a cell runs; so does this test, whatever
    # an earlier test in this process left installed).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(RankError) as info:
            # rank 1 sleeps in Python; rank 0 waits in a gloo all-reduce that rank 1 never joins
            lab.run(
                "import time\nif rank == 1:\n    time.sleep(60)\nt = torch.ones(1)\ndist.all_reduce(t)", stream=False
            )
    finally:
        signal.signal(signal.SIGINT, before)
    stopped = time.monotonic() - t0 - 1.0
    # Generous: rank 1 sleeps 60 s and rank 0 would wait out the collective timeout if not stopped.
    assert stopped < lab.timeout / 2, f"took {stopped:.2f} s to stop (SIGINT handler before the test: {before!r})"
    assert set(info.value.ranks) == {0, 1}
    assert lab.status() and all(row.health == "ok" for row in lab.status())
    assert dict(lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False)) == {0: 2.0, 1: 2.0}


def test_a_stop_signal_that_arrives_as_the_cell_ends_does_not_lose_the_ranks_reply(lab):
    # distlab stops ranks with SIGINT, and a rank can finish on its own just as the signal is sent.
    # Here it lands while the engine packs the reply (the value's __reduce__ runs after the code).
    code = (
        "import os, signal\n"
        "class Late:\n"
        "    def __reduce__(self):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        return (int, (7 + rank,))\n"
        "Late()"
    )
    assert dict(lab.run(code, timeout=5, stream=False)) == {0: 7, 1: 8}
    assert dict(lab.run("rank", stream=False)) == {0: 0, 1: 1}


def test_a_stop_signal_that_arrives_before_the_cells_code_starts_still_stops_it(lab):
    # Here it lands while the rank prepares the cell (IPython's input transformers run then).
    lab.run(
        "import os, signal\n"
        "from IPython import get_ipython\n"
        "_shots = [1]\n"
        "def _stop_now(lines):\n"
        "    if _shots:\n"
        "        _shots.pop()\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return lines\n"
        "get_ipython().input_transformers_cleanup.append(_stop_now)",
        stream=False,
    )
    try:
        with pytest.raises(RankError) as info:
            lab.run("ran = True", timeout=10, stream=False)
        assert {r: f.ename for r, f in info.value.failures.items()} == {0: "KeyboardInterrupt", 1: "KeyboardInterrupt"}
        assert dict(lab.run("'ran' in globals()", stream=False)) == {0: False, 1: False}
    finally:
        lab.run("get_ipython().input_transformers_cleanup.remove(_stop_now)", stream=False)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"ranks": 0}, "ranks must be >= 1"),
        ({"ranks": -1}, "ranks must be >= 1"),
        ({"ranks": "two"}, "whole number"),
        ({"backend": "mpi-ish"}, "unknown backend"),
        ({"timeout": 0}, "timeout must be a number of seconds > 0"),
        ({"timeout": -3}, "timeout must be a number of seconds > 0"),
        ({"launcher": "carrier-pigeon"}, "unknown launcher"),
        ({"ranks": 2, "nodes": 0}, "nodes must be >= 1"),
        ({"ranks": 2, "nodes": 3}, "nodes 3 is more nodes than ranks"),
        ({"ranks": 2, "nodes": "two"}, "nodes must be a whole number"),
        ({"ranks": 2, "nodes": 2, "link": "fast"}, "link must be a bandwidth with a unit"),
        ({"ranks": 2, "nodes": 2, "link": "1gbps"}, "link must be a bandwidth with a unit"),
        ({"ranks": 2, "nodes": 2, "link": "1gbit", "latency": -1}, "latency must be >= 0"),
        ({"ranks": 2, "nodes": 2, "link": "1gbit", "latency": "-1ms"}, "latency must be >= 0"),
        ({"ranks": 2, "nodes": 2, "latency": "1ms"}, "latency delays a shaped link: give link too"),
        ({"ranks": 2, "link": "1gbit"}, "link sets the network between nodes: give nodes too"),
        ({"ranks": 2, "subnet": "198.18.9.0/24"}, "subnet sets the network between nodes: give nodes too"),
        ({"ranks": 2, "nodes": 2, "subnet": "10.1.2.0/30"}, "has room for 2 addresses"),
        ({"ranks": 2, "nodes": 2, "subnet": "nowhere"}, "subnet must be an IPv4 network"),
        ({"ranks": 2, "nodes": 2, "launcher": "mpi"}, "with the local launcher"),
    ],
)
def test_bad_start_arguments_are_refused_before_anything_starts(kwargs, fragment):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    from conftest import lab_namespaces

    namespaces = lab_namespaces()
    with pytest.raises(LabUsageError) as info:
        distlab.start(**kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before
    assert lab_namespaces() <= namespaces


@pytest.mark.cluster
def test_nccl_without_a_gpu_is_refused_with_the_fix_before_any_engine_or_torch():
    from conftest import python_lines

    from distlab.cluster.gpus import local_gpus

    if local_gpus() != 0:
        pytest.skip("this machine has a GPU (or may: ROCm)")
    # In a process of its own: the refusal comes from the driver's count, so torch never loads there.
    code = (
        "import sys, distlab\n"
        "try:\n    distlab.start(ranks=2, backend='nccl')\n"
        "except distlab.LabUsageError as e:\n    print(e)\n"
        "print('torch' in sys.modules)\n"
    )
    printed = python_lines(code, timeout_s=120)
    refusal, torch_loaded = printed
    assert "use --backend gloo" in refusal and torch_loaded == "False", printed


def test_stop_leaves_no_process_or_file_behind(lab_factory):
    import glob

    from conftest import distlab_processes

    from distlab import ipycompat

    before = {p.pid for p in distlab_processes()}
    lab = lab_factory(ranks=2)
    started = {p.pid for p in distlab_processes()} - before
    assert len(started) >= 3  # controller, 2 engines (+ nannies, reaper)
    engine_pids = [row.pid for row in lab.status()]
    # ipyparallel's files for the cluster; the hub's engine state (engines<id>.json) was left by every stop.
    patterns = ipycompat.cluster_files(lab.processes.cluster)
    assert any("engines" in path for pattern in patterns for path in glob.glob(pattern))
    lab.stop()
    assert [path for pattern in patterns for path in glob.glob(pattern)] == []
    assert not lab.running
    _, alive = psutil.wait_procs([psutil.Process(p) for p in started if psutil.pid_exists(p)], timeout=5)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in engine_pids)


def test_a_controller_that_dies_as_it_starts_is_said_with_what_it_wrote_and_leaves_nothing(monkeypatch):
    from conftest import distlab_processes

    from distlab.cluster import launch
    from distlab.errors import DistlabError

    before = {p.pid for p in distlab_processes()}
    # Ports no controller can have: ipyparallel's refuses them as it starts, and exits.
    monkeypatch.setattr(launch, "controller_ports", lambda ip: range(70_000, 70_032))
    with pytest.raises(DistlabError, match=r"(?s)Controller stopped.*it wrote last:.*greater than 65536"):
        distlab.start(ranks=2, timeout=60)
    _, alive = psutil.wait_procs([p for p in distlab_processes() if p.pid not in before], timeout=30)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"


def test_two_labs_at_once_get_their_own_ports_and_do_not_interfere(lab, lab_factory):
    other = lab_factory(ranks=2)
    port_a = lab.run("import os\nos.environ['MASTER_PORT']", stream=False)[0]
    port_b = other.run("import os\nos.environ['MASTER_PORT']", stream=False)[0]
    assert port_a != port_b
    assert dict(other.run("t = torch.ones(1) * 5; dist.all_reduce(t); t.item()", stream=False)) == {0: 10.0, 1: 10.0}
    assert dict(lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False)) == {0: 2.0, 1: 2.0}


def test_restart_gives_fresh_processes_with_the_same_ranks(lab_factory):
    lab = lab_factory(ranks=2)
    lab.run("marker = 1", stream=False)
    old = lab.status()
    lab.restart()
    new = lab.status()
    assert [r.rank for r in new] == [0, 1]
    assert {r.pid for r in new}.isdisjoint({r.pid for r in old})
    # The restart returns once the new world works; the old one, signalled first, ends beside it.
    assert wait_for(lambda: not any(pid_alive(r.pid) for r in old), 10.0), [r.pid for r in old if pid_alive(r.pid)]
    assert dict(lab.run("'marker' in globals(), rank", stream=False)) == {0: (False, 0), 1: (False, 1)}
    assert dict(lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False)) == {0: 2.0, 1: 2.0}


def test_a_killed_rank_is_reported_dead_and_restart_brings_it_back(lab_factory):
    lab = lab_factory(ranks=2)
    lab.kill(1)
    assert [row.health for row in lab.status()] == ["ok", "dead"]
    lab.restart()
    assert [row.health for row in lab.status()] == ["ok", "ok"]


def test_four_ranks_all_reduce_and_group_by_host(lab_factory):
    lab = lab_factory(ranks=4)
    assert [r.local_rank for r in lab.table] == [0, 1, 2, 3]
    values = lab.run("t = torch.tensor([float(rank)]); dist.all_reduce(t); (world_size, t.item())", stream=False)
    assert dict(values) == dict.fromkeys(range(4), (4, 6.0))


def test_stopping_a_lab_lets_each_rank_exit_as_python_would(lab_factory, tmp_path):
    # What a rank's own exit does for the user is kept however the stop is made fast: buffered
    # writes to a file a cell left open are flushed, and the exit handlers a cell registered run.
    lab = lab_factory(ranks=2)
    lab.push(DIR=str(tmp_path))
    lab.run(
        "import atexit, os\n"
        "left_open = open(os.path.join(DIR, f'open-{rank}.txt'), 'w')\n"
        "left_open.write('written but never flushed')\n"
        "atexit.register(lambda: open(os.path.join(DIR, f'atexit-{rank}.txt'), 'w').write('ran'))\n",
        stream=False,
    )
    assert (tmp_path / "open-0.txt").read_text() == ""  # still in the rank's buffer
    lab.stop()
    for rank in (0, 1):
        assert (tmp_path / f"open-{rank}.txt").read_text() == "written but never flushed"
        assert (tmp_path / f"atexit-{rank}.txt").read_text() == "ran"
