"""Live stacks as py-spy gives them, cut to the user's code and folded across ranks (no process started)."""

from __future__ import annotations

import pytest

from distlab.cluster import stacks
from distlab.errors import DistlabError

ENGINE = "/venv/lib/python3.11/site-packages"


def _frame(name: str, filename: str, line: int, short: str | None = None) -> dict[str, object]:
    return {"name": name, "filename": filename, "short_filename": short or filename.rsplit("/", 1)[-1], "line": line}


def _dump(pid: int, cell: str, innermost: list[dict[str, object]]) -> list[dict[str, object]]:
    """A rank's main thread in a cell (innermost frame first, as py-spy lists them) and an idle helper thread."""
    engine = [
        _frame("run", "/repo/distlab/rank/cell.py", 79, "distlab/rank/cell.py"),
        _frame("on_rank", "/repo/distlab/rank/dispatch.py", 21, "distlab/rank/dispatch.py"),
        _frame("<module>", "<string>", 1),
        _frame("do_apply", f"{ENGINE}/ipyparallel/engine/kernel.py", 157, "ipyparallel/engine/kernel.py"),
        _frame("run_forever", "/usr/lib/python3.11/asyncio/base_events.py", 608, "asyncio/base_events.py"),
        _frame("<module>", "<frozen runpy>", 88),
        _frame("0x7f00", "libc.so.6", 0),
    ]
    main = {"os_thread_id": pid, "thread_name": "MainThread", "active": False,
            "frames": [*innermost, _frame("<module>", cell, 4), *engine]}
    helper = {"os_thread_id": pid + 1, "thread_name": "Thread-1", "active": False,
              "frames": [_frame("wait", "/usr/lib/python3.11/threading.py", 320),
                         _frame("select", "/usr/lib/python3.11/selectors.py", 468)]}
    return [helper, main]  # py-spy lists threads in no set order: the main one is found by its id


SOURCE = ["import time", "def waiting_here():", "    time.sleep(30)", "waiting_here()"]
SLEEPING = [_frame("waiting_here", "<rank {r} cell>", 3)]


def _sleeping(rank: int) -> tuple[stacks.Thread, ...]:
    cell = f"<rank {rank} cell>"
    inner = [dict(f, filename=cell) for f in SLEEPING]
    return stacks._threads(_dump(100 + rank, cell, inner), 100 + rank, {cell: SOURCE})


def test_a_stack_is_cut_to_the_users_code_outermost_first_with_the_cells_lines():
    main = _sleeping(0)[0]
    assert main.name == "MainThread"
    assert [(f.name, f.filename, f.line, f.text) for f in main.frames] == [
        ("<module>", "<cell>", 4, "waiting_here()"),
        ("waiting_here", "<cell>", 3, "time.sleep(30)"),
    ]


def test_ranks_with_the_same_stack_are_shown_once_and_the_others_apart():
    torch_frame = _frame("all_reduce", "/venv/torch/distributed/distributed_c10d.py", 3252,
                         "torch/distributed/distributed_c10d.py")
    waiting = stacks._threads(_dump(102, "<rank 2 cell>", [torch_frame]), 102, {})
    taken = stacks.Stacks({0: _sleeping(0), 1: _sleeping(1), 2: waiting}, {3: "it runs on node-b"})
    assert str(taken).splitlines() == [
        "ranks 0-1 (MainThread), most recent call last:",
        "    <module> (<cell>:4)    waiting_here()",
        "    waiting_here (<cell>:3)    time.sleep(30)",
        "rank 2 (MainThread), most recent call last:",
        "    <module> (<cell>:4)",
        "    all_reduce (torch/distributed/distributed_c10d.py:3252)",
        "rank 3: not read: it runs on node-b",
    ]
    # Every thread: the helper waits in the standard library only, so it is shown idle.
    assert "ranks 0-1 (Thread-1): idle\n" in taken.text(all_threads=True)


def test_a_rank_with_only_the_engines_frames_is_idle_and_a_thread_with_no_python_keeps_its_native_frames():
    engine_only = {"os_thread_id": 7, "thread_name": "MainThread", "active": False,
                   "frames": [_frame("select", "/usr/lib/python3.11/selectors.py", 468),
                              _frame("run_forever", "/usr/lib/python3.11/asyncio/base_events.py", 608)]}
    native = {"os_thread_id": 8, "thread_name": "gloo", "active": True,
              "frames": [_frame("gloo::transport::tcp::Loop::run", "libtorch_cpu.so", 0)]}
    main, other = stacks._threads([native, engine_only], 7, {})
    assert main.idle and main.name == "MainThread"
    # a warm rank's outer frames: the template it was forked from and the engine's entry point (by path)
    forked = {"os_thread_id": 9, "thread_name": "MainThread", "active": False, "frames": [
        _frame("select", "/usr/lib/python3.11/selectors.py", 468),
        _frame("main", "/repo/distlab/rank/engine_main.py", 41, "distlab/rank/engine_main.py"),
        _frame("_child", "/repo/distlab/rank/warm_template.py", 112, "distlab/rank/warm_template.py"),
        _frame("<module>", "/repo/distlab/rank/warm_template.py", 219, "distlab/rank/warm_template.py"),
    ]}
    (warm,) = stacks._threads([forked], 9, {})
    assert warm.idle, warm.frames
    assert [f.name for f in other.frames] == ["gloo::transport::tcp::Loop::run"] and other.active


def test_without_py_spy_the_error_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DistlabError, match="py-spy is not installed here: pip install py-spy"):
        stacks.take({0: 1})
