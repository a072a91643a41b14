"""A line several ranks print alike shows once, with their ranks; each rank's lines keep their order
(the printer alone, fed as a cell's polls feed it: no process started)."""

from __future__ import annotations

import pytest

from distlab.notebook import streams


class Ranks:
    """What each rank has printed so far (ipyparallel accumulates it), fed to a printer poll by poll."""

    def __init__(self, printer: streams.RankPrinter) -> None:
        self.printer, self.said = printer, {}

    def say(self, rank: int, *lines: str) -> None:
        self.said[rank] = self.said.get(rank, "") + "".join(line + "\n" for line in lines)

    def poll(self, final: bool = False, ended: tuple[int, ...] = ()) -> None:
        for rank, text in sorted(self.said.items()):
            self.printer.feed(rank, "stdout", text, final)
        self.printer.flush(final, ended)


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(streams.time, "monotonic", lambda: now[0])
    return now


def test_a_line_every_rank_printed_shows_once_and_the_ones_that_differ_per_rank(capsys, clock):
    ranks = Ranks(streams.RankPrinter(ranks=range(8)))
    for r in range(8):
        ranks.say(r, "epoch 1 done", f"loss {r}", "saved")
    ranks.poll()
    assert capsys.readouterr().out.splitlines() == [
        "[ranks 0-7] epoch 1 done",
        *(f"[rank {r}] loss {r}" for r in range(8)),
        "[ranks 0-7] saved",
    ]


def test_a_line_waits_for_the_others_until_they_print_it_move_past_it_or_the_hold_ends(capsys, clock):
    ranks = Ranks(streams.RankPrinter(ranks=range(3)))
    ranks.say(0, "ready")
    ranks.say(1, "ready")
    ranks.poll()
    assert capsys.readouterr().out == ""  # rank 2 may still print it
    ranks.say(2, "ready")
    ranks.poll()
    assert capsys.readouterr().out == "[ranks 0-2] ready\n"

    ranks.say(0, "only rank 0 says this")
    ranks.poll()
    clock[0] += streams.HOLD_S / 2
    ranks.poll()
    assert capsys.readouterr().out == ""
    clock[0] += streams.HOLD_S  # the others printed nothing since: it shows, alone
    ranks.poll()
    assert capsys.readouterr().out == "[rank 0] only rank 0 says this\n"

    ranks.say(1, "rank 1's line")
    ranks.say(2, "something else")  # rank 2 moved past it: no wait for rank 2 ...
    ranks.poll(ended=(0,))  # ... nor for rank 0, whose cell has ended
    assert capsys.readouterr().out == "[rank 1] rank 1's line\n"
    ranks.poll(final=True)
    assert capsys.readouterr().out == "[rank 2] something else\n"


def test_each_ranks_lines_keep_their_order_when_they_fold(capsys, clock):
    ranks = Ranks(streams.RankPrinter(ranks=range(2)))
    ranks.say(0, "a", "b")
    ranks.say(1, "b", "a")  # rank 1's "a" comes after its "b": it cannot join rank 0's "a"
    ranks.poll(final=True)
    out = capsys.readouterr().out.splitlines()
    assert out == ["[rank 0] a", "[ranks 0-1] b", "[rank 1] a"]
    for r in (0, 1):
        mine = [line.split("] ")[1] for line in out if f"rank {r}]" in line or ("ranks" in line and "0-1" in line)]
        assert mine == (["a", "b"] if r == 0 else ["b", "a"])


def test_a_cell_on_one_rank_prints_at_once_and_an_unfinished_line_at_the_end(capsys, clock):
    printer = streams.RankPrinter(ranks=[3])
    printer.feed(3, "stdout", "hello\npartial")
    assert capsys.readouterr().out == "[rank 3] hello\n"
    printer.feed(3, "stdout", "hello\npartial", final=True)
    assert capsys.readouterr().out == "[rank 3] partial\n"


@pytest.mark.cluster
def test_eight_real_ranks_printing_alike_show_one_line_and_their_own_lines_apart(lab_factory, capsys, monkeypatch):
    # A generous hold: on a loaded machine 8 ranks on 2 cores may print the same line far apart.
    monkeypatch.setattr(streams, "HOLD_S", 10.0)
    lab = lab_factory(ranks=8)
    capsys.readouterr()
    lab.run("dist.barrier()\nprint('epoch 1 done')\nprint(f'loss of rank {rank}')\ndist.barrier()\nprint('saved')")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[ranks 0-7] epoch 1 done", out
    assert sorted(out[1:9]) == [f"[rank {r}] loss of rank {r}" for r in range(8)], out
    assert out[9:] == ["[ranks 0-7] saved"], out


# What torch's reducer printed on a rank of a lab that heals (torchft's DDP always asks for unused parameters).
_REDUCER_WARNING = (
    "[rank0]:[W1206 05:14:24.072476423 reducer.cpp:1529] Warning: find_unused_parameters=True was specified in "
    "DDP constructor, but did not find any unused parameters in the forward pass. This flag results in an extra "
    "traversal of the autograd graph every iteration,  which can adversely affect performance. (function operator())"
)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_lab_that_heals_leaves_torchfts_reducer_warning_out_and_shows_every_other_line(capsys, clock, ranks):
    shown = {}
    for hidden in ((), streams.HEALING_NOISE):
        printer = Ranks(streams.RankPrinter(ranks=range(ranks), hidden=hidden))
        for r in range(ranks):
            printer.say(r, _REDUCER_WARNING, "<rank cell>:5: UserWarning: the learner's own")
        printer.poll(final=True)
        shown[hidden] = capsys.readouterr().out
    assert "find_unused_parameters" in shown[()]
    assert "find_unused_parameters" not in shown[streams.HEALING_NOISE]
    assert shown[streams.HEALING_NOISE].count("UserWarning: the learner's own") == 1
