import pytest

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
