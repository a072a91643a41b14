"""Live stacks of real ranks (py-spy), while a cell runs, between cells, and in a hang's error."""

from __future__ import annotations

import threading
import time

import pytest

from distlab.errors import CellTimeout, LabUsageError

pytestmark = pytest.mark.cluster

WAITING = "import time\ndef waiting_here():\n    time.sleep(SECONDS)\nwaiting_here()\n"


def _read_while_running(lab, code: str, when_s: float, **kwargs):
    """``lab.stacks(**kwargs)`` from another thread, ``when_s`` into the cell ``code`` (the notebook's
    thread is the cell's, as in a notebook)."""
    taken = {}

    def read() -> None:
        time.sleep(when_s)
        taken["stacks"] = lab.stacks(**kwargs)

    reader = threading.Thread(target=read)
    reader.start()
    lab.run(code, stream=False)
    reader.join(60)
    return taken["stacks"]


def test_stacks_while_a_cell_runs_show_every_rank_in_its_function_and_line_folded(lab):
    # The code starts with a blank line (a triple-quoted string's): the ranks' IPython drops it, and
    # the lines shown are those the ranks numbered.
    taken = _read_while_running(lab, "\n" + WAITING.replace("SECONDS", "4"), 2.0)
    assert taken.text().splitlines() == [
        "ranks 0-1 (MainThread), most recent call last:",
        "    <module> (<cell>:4)    waiting_here()",
        "    waiting_here (<cell>:3)    time.sleep(4)",
    ]
    assert not taken.missing
    # Between cells every rank waits for the next one.
    assert lab.stacks().text() == "ranks 0-1 (MainThread): idle, no cell running"


def test_native_stacks_go_down_into_c(lab):
    taken = _read_while_running(lab, WAITING.replace("SECONDS", "5"), 2.0, ranks=1, native=True)
    main = taken.main(1)
    assert main is not None and list(taken.threads) == [1]
    names = [f.name for f in main.frames]
    assert names[:2] == ["<module>", "waiting_here"], names
    # Under the cell's sleep: the interpreter's C (time.sleep) and the C library's call.
    assert any(f.line == 0 and ".so" in f.filename for f in main.frames[2:]), main.frames


def test_a_hangs_error_shows_where_each_rank_was_before_it_was_stopped(lab):
    code = (
        "import time\n"
        "def stuck_here():\n"
        "    time.sleep(60)\n"
        "if rank == 1:\n"
        "    stuck_here()\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    with pytest.raises(CellTimeout) as info:
        lab.run(code, timeout=3, stream=False)
    said = str(info.value)
    assert "when the cell was stopped (their live stacks):" in said
    stacks = said.split("when the cell was stopped (their live stacks):")[1]
    # Rank 0 inside torch's all_reduce (where the stop's KeyboardInterrupt would not show it: it
    # cannot reach a rank inside a C++ collective); rank 1 in the function that never returned.
    rank0, rank1 = stacks.split("rank 1 (MainThread)")
    assert "<module> (<cell>:6)    dist.all_reduce(torch.ones(1))" in rank0
    assert "all_reduce (torch/distributed/distributed_c10d.py:" in rank0
    assert "stuck_here (<cell>:3)    time.sleep(60)" in rank1
    # The lab is usable again after the stop.
    assert lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False) == {0: 2.0, 1: 2.0}


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"ranks": 2}, "rank 2 does not exist in a world of 2"),
        ({"native": "yes"}, "native must be True or False"),
        ({"timeout": 0}, "timeout must be"),
    ],
)
def test_bad_input_gets_one_line(lab, kwargs, says):
    with pytest.raises(LabUsageError, match=says) as info:
        lab.stacks(**kwargs)
    assert "\n" not in str(info.value)


def test_the_magic_prints_the_stacks_of_the_ranks_asked(ipython, capsys):
    ipython.run_line_magic("dist", "start -n 2")
    capsys.readouterr()
    ipython.run_line_magic("dist", "stacks 1 --all")
    out = capsys.readouterr().out
    assert out.startswith("rank 1 (MainThread): idle, no cell running\n"), out
    assert "rank 0" not in out
