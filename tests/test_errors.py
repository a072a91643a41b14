import os

import pytest

import distlab
from distlab.errors import LabUsageError, RankError, RankFailure, format_ranks, parse_ranks


@pytest.mark.parametrize(
    "spec, world, expected",
    [
        ("0", 4, [0]),
        ("0,2-3", 4, [0, 2, 3]),
        (" 1 - 2 , 0 ", 4, [0, 1, 2]),
        ("3,3,1", 4, [1, 3]),
        (2, 4, [2]),
        ([1, 0], 2, [0, 1]),
    ],
)
def test_rank_specs_are_parsed_into_sorted_ranks(spec, world, expected):
    assert parse_ranks(spec, world) == expected


@pytest.mark.parametrize(
    "spec, world, fragment",
    [
        ("4", 4, "rank 4 does not exist in a world of 4"),
        ("0-9", 2, "rank 2-9 does not exist"),
        ("-1", 4, "not a rank or a range"),
        ("x", 4, "not a rank or a range"),
        ("1,,2", 4, "not a rank or a range"),
        ("3-1", 4, "runs backwards"),
        ("", 4, "no ranks given"),
        ("__import__('os')", 4, "not a rank or a range"),
        (True, 4, "must be numbers"),
        ([0, "1"], 4, "whole numbers"),
    ],
)
def test_bad_rank_specs_say_what_is_wrong_and_how_to_write_them(spec, world, fragment):
    with pytest.raises(LabUsageError) as info:
        parse_ranks(spec, world)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_rank_lists_are_written_as_ranges():
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_ranks([3]) == "3"


def test_identical_failures_on_several_ranks_are_grouped_and_shown_once():
    tb = 'Traceback (most recent call last):\n  File "<rank {r} cell>", line 1\nZeroDivisionError: division by zero\n'
    failures = {r: RankFailure(r, "ZeroDivisionError", "division by zero", tb.format(r=r)) for r in range(4)}
    failures[2] = RankFailure(2, "KeyError", "'x'", "Traceback ...\nKeyError: 'x'\n")
    err = RankError(failures, notes=["process group rebuilt"])
    assert err.summary.splitlines() == [
        "ranks 0-1,3: ZeroDivisionError: division by zero",
        "rank 2: KeyError: 'x'",
        "process group rebuilt",
    ]
    rendered = err.render()
    assert rendered.count("ZeroDivisionError: division by zero") == 2  # headline + one traceback
    assert err.ranks == [0, 1, 2, 3]


def test_the_report_leads_with_its_cause_and_the_ranks_stopped_for_it_take_a_line_each():
    torch_frame = (
        '  File "/home/ada/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, '
        "in all_reduce\n    work.wait()\n"
    )
    stopped = RankFailure(
        0, "Stopped", "stopped by distlab: rank 2 failed; it was at line 10: dist.all_reduce(t)",
        f'Traceback (most recent call last):\n  File "<rank 0 cell>", line 10\n{torch_frame}RuntimeError: GLHF\n',
    )
    first = RankFailure(2, "ValueError", "corrupt shard", f"Traceback:\n{torch_frame}ValueError: corrupt shard\n", 50.0)
    later = RankFailure(1, "KeyError", "'x'", "Traceback ...\nKeyError: 'x'\n", 51.5)
    report = RankError({0: stopped, 1: later, 2: first}, notes=["process group rebuilt"]).render().splitlines()
    # The first rank to raise, then the next; the rank distlab stopped last, in one line, no frames.
    assert [line for line in report if not line.startswith(" ")] == [
        "rank 2: ValueError: corrupt shard",
        "rank 1: KeyError: 'x'",
        "rank 0: Stopped: stopped by distlab: rank 2 failed; it was at line 10: dist.all_reduce(t)",
        "process group rebuilt",
    ]
    assert "GLHF" not in "\n".join(report)
    # No machine's paths: a frame in a package is named from the package.
    assert '      File "torch/distributed/distributed_c10d.py", line 3252, in all_reduce' in report
    installed = os.path.dirname(distlab.__file__)  # site-packages/distlab, or the source folder's (editable)
    mine = RankError({0: RankFailure(0, "X", "", f'  File "{installed}/rank/cell.py", line 4\n')}).render()
    assert '  File "distlab/rank/cell.py", line 4' in mine
    # A rank that died comes before those that raised.
    died = RankError({1: later, 3: RankFailure(3, "EngineError", "the rank's process died")})
    assert died.summary.splitlines()[0] == "rank 3: EngineError: the rank's process died"


def test_outside_ipython_the_message_carries_each_distinct_traceback_once():
    # A script's user (python train_in_lab.py), a log, a CI run see str(err): the ranks' tracebacks are in it.
    tb = 'Traceback (most recent call last):\n  File "<rank {r} cell>", line 3, in <module>\n    y = x / 0\n' \
         "ZeroDivisionError: division by zero\n"
    err = RankError({r: RankFailure(r, "ZeroDivisionError", "division by zero", tb.format(r=r)) for r in (0, 1)},
                    notes=["process group rebuilt"])
    assert str(err) == err.render() == (
        "ranks 0-1: ZeroDivisionError: division by zero\n"
        "    Traceback (most recent call last):\n"
        '      File "<rank 0 cell>", line 3, in <module>\n'
        "        y = x / 0\n"
        "    ZeroDivisionError: division by zero\n"
        "process group rebuilt"
    )
    assert str(err).splitlines()[0] == err.summary.splitlines()[0]  # the headline still comes first


def test_ipython_shows_the_report_once_as_before(ipython, capsys):
    tb = 'Traceback (most recent call last):\n  File "<rank 0 cell>", line 1, in <module>\nKeyError: \'x\'\n'
    ipython.user_ns["err"] = RankError({0: RankFailure(0, "KeyError", "'x'", tb)})
    ipython.run_cell("raise err")
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert "rank 0: KeyError: 'x'\n    Traceback (most recent call last):" in text
    assert text.count("KeyError: 'x'") == 2  # the headline and the rank's traceback: not IPython's own, nor twice
    assert "distlab/errors.py" not in text and "raise err" not in text
