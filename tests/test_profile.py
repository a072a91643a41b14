"""``lab.profile``: torch.profiler on real ranks, merged; the overlap arithmetic on traces made by hand."""

from __future__ import annotations

import json
import zlib

import pytest

from distlab.dashboard import profile as analysis
from distlab.errors import LabUsageError
from distlab.front.lab import Lab

TRAIN = """
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(STEPS):
    opt.zero_grad()
    model(torch.randn(64, 256)).sum().backward()
    opt.step()
"""


def _op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 4242, "tid": tid, "ts": ts, "dur": dur}


def _packed(events, base_ns=0, steps=2, whole=False, tid=1):
    doc = {"baseTimeNanoseconds": base_ns, "traceEvents": events}
    return {
        "trace": zlib.compress(json.dumps(doc).encode()), "steps": steps, "whole": whole,
        "optimizer_steps": steps + 2, "tid": tid,
    }


def test_interval_arithmetic():
    assert analysis.union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert analysis.intersect([(0, 3), (5, 8)], [(2, 6), (7, 10)]) == [(2, 3), (5, 6), (7, 8)]
    assert analysis.subtract([(0, 3), (5, 8)], [(1, 2), (6, 10)]) == [(0, 1), (2, 3), (5, 6)]
    assert analysis.subtract([(0, 3)], []) == [(0, 3)]
    assert analysis.total([(0, 3), (5, 8)]) == 6


def test_a_hand_made_cpu_trace_gives_the_numbers_known_by_construction():
    # The cell's thread (tid 1): compute 0-40 (with ops nested inside, counted once) and 60-100; a
    # c10d call at 40-45 only hands work to gloo. Another thread's op (tid 9) is not the cell's.
    # gloo's workers (tids 2, 3): 30-50 and 45-70 overlap each other, union 30-70.
    # compute = 80; communication = 40; overlapped = 30-40 and 60-70 = 20; exposed = 40-60 = 20.
    # The second step ends at 120, 20 after its last op: idle = 20.
    events = [
        _op("aten::linear", 0, 40), _op("aten::addmm", 5, 20), _op("aten::mm", 6, 10),
        _op("c10d::allreduce_", 40, 5), _op("aten::empty", 41, 1),
        _op("autograd::engine::evaluate_function: AddmmBackward0", 60, 40), _op("aten::mm", 70, 10),
        _op("aten::add", 45, 10, tid=9),
        _op("gloo:all_reduce", 30, 20, tid=2, cat="user_annotation"),
        _op("gloo:all_reduce", 45, 25, tid=3, cat="user_annotation"),
        _op("ProfilerStep#1", 0, 50, cat="user_annotation"), _op("ProfilerStep#2", 50, 70, cat="user_annotation"),
        {"ph": "M", "name": "process_name", "pid": 4242, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": 4242, "tid": 2, "args": {"name": "pt_gloo_runloop"}},
        {"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "id": 3, "pid": 4242, "tid": 1, "ts": 6},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "x", "ts": 0, "dur": 100},
    ]
    # Rank 1's clock base is 1 ms later: its events land 1000 us later on the merged axis.
    document, profiles = analysis.merge({0: _packed(events), 1: _packed(events, base_ns=1_000_000)})
    for p in profiles:
        assert (p.compute_ms, p.communication_ms, p.exposed_ms, p.idle_ms) == (0.08, 0.04, 0.02, 0.02)
        assert p.overlap_pct == 50.0
        assert p.exposed == [(p.communication[0][0] + 10, p.communication[0][0] + 30)]
        assert p.steps == 2 and len(p.step_starts) == 2
    merged = document["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    names = {e["pid"]: e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert sorted(e["id"] for e in merged if e.get("ph") == "s") == [6, 7]  # unique per rank
    starts = {e["pid"]: e["ts"] for e in merged if e.get("name") == "aten::linear"}
    assert starts == {0: 0.0, 1: 1000.0}
    assert not any(e.get("cat") == "Trace" for e in merged)
    assert profiles[0].row() == {
        "rank": 0, "steps": 2, "compute_ms": 0.08, "communication_ms": 0.04, "exposed_ms": 0.02, "idle_ms": 0.02,
        "overlap_pct": 50.0,
    }
    text = analysis.table_text(profiles, "trace.json")
    assert "50%" in text and "trace.json" in text
    assert analysis.render_png(profiles, text).startswith(b"\x89PNG")


def test_a_gpu_trace_is_read_from_its_kernels_as_hta_does():
    events = [
        _op("ampere_sgemm", 0, 50, tid=7, cat="kernel"),
        _op("ncclDevKernel_AllReduce_Sum_f32", 40, 20, tid=20, cat="kernel"),
        _op("Memcpy DtoD", 55, 30, tid=7, cat="kernel"),
        _op("aten::mm", 0, 100),  # CPU ops do not count where there are kernels
    ]
    _, (p,) = analysis.merge({0: _packed(events)})
    assert (p.compute_ms, p.communication_ms, p.exposed_ms, p.overlap_pct) == (0.05, 0.02, 0.01, 50.0)
    assert p.idle_ms == 0  # no steps: the span from the first kernel to the last, all busy
    assert p.source.startswith("GPU kernels")


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"steps": 0}, "steps must be >= 1"),
        ({"steps": 2.5}, "steps must be a whole number"),
        ({"steps": 3, "warmup": -1}, "warmup must be >= 0"),
        ({"steps": 3, "path": "/no/such/folder/p.json"}, "give a file in a folder that exists"),
        ({"steps": 3}, "no lab is running"),
    ],
)
def test_bad_input_gets_one_line(kwargs, says):
    with pytest.raises(LabUsageError, match=says) as info:
        Lab(ranks=2).profile(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.cluster
def test_two_ranks_training_ddp_are_profiled_and_merged(lab_factory, tmp_path):
    lab = lab_factory(ranks=2)
    with lab.profile(steps=3, path=tmp_path / "p.json") as prof:
        with pytest.raises(LabUsageError, match="no cell has been profiled yet"):
            prof.table()
        lab.run(TRAIN.replace("STEPS", "7"), stream=False)
    assert prof.path == str(tmp_path / "p.json")
    with open(prof.path) as f:
        merged = json.load(f)["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    names = {e["pid"]: e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        mine = [e for e in merged if e["pid"] == rank and e.get("ph") == "X"]
        assert any(e["name"].startswith("gloo:all_reduce") for e in mine)
        assert sum(e["name"].startswith("ProfilerStep#") for e in mine) == 3
    rows = prof.table()
    assert [row["rank"] for row in rows] == [0, 1]
    for row in rows:
        assert row["steps"] == 3
        assert row["compute_ms"] > 0 and row["communication_ms"] > 0
        assert 0 <= row["overlap_pct"] <= 100
        assert row["exposed_ms"] <= row["communication_ms"]
    bundle = prof._repr_mimebundle_()
    assert "image/png" in bundle and "overlap" in bundle["text/plain"]

    # A cell with fewer steps keeps what it recorded; one with no optimizer is profiled whole.
    with lab.profile(steps=3, path=tmp_path / "short.json") as short:
        lab.run(TRAIN.replace("STEPS", "3"), stream=False)  # the first, 1 of warmup, 1 recorded
    assert [row["steps"] for row in short.table()] == [1, 1]
    with lab.profile(steps=2, path=tmp_path / "whole.json") as whole:
        lab.run("dist.all_reduce(torch.ones(1000) @ torch.ones(1000, 1000))", stream=False)
    assert "whole" in whole.text()
    assert all(row["communication_ms"] > 0 for row in whole.table())

    # Left without a cell: disarmed, and the next cell runs unprofiled.
    with lab.profile(steps=2) as unused:
        assert unused.armed
    assert not unused.armed
    lab.run("x = 1", stream=False)
    assert not unused.done


@pytest.mark.cluster
def test_the_magic_profiles_the_next_ddp_cell_and_shows_it(ipython, capsys, tmp_path):
    ipython.run_line_magic("dist", "start -n 2")
    ipython.run_line_magic("dist", f"profile --steps 2 --warmup 0 --path {tmp_path / 'm.json'}")
    assert "the next %%ddp cell is profiled" in capsys.readouterr().out
    ipython.run_cell_magic("ddp", "", TRAIN.replace("STEPS", "4"))
    out = capsys.readouterr().out
    assert "exposed comm ms" in out and str(tmp_path / "m.json") in out, out
    ipython.run_cell_magic("ddp", "", "x = 1")
    assert "exposed comm ms" not in capsys.readouterr().out  # shown once
