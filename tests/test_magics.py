"""%dist and %%ddp in a real IPython shell."""

from __future__ import annotations

import re

import pytest
from conftest import distlab_processes
from IPython.core.error import UsageError

import distlab
import distlab.front.magics

BAD_BEFORE_START = [
    ("dist", "start -n 0", "-n must be >= 1"),
    ("dist", "start -n -1", "-n must be >= 1"),
    ("dist", "start -n two", "-n must be a whole number"),
    ("dist", "start -n 2 --backend nvlink", "unknown backend 'nvlink'"),
    ("dist", "start -n 2 --timeout 0", "--timeout must be a number of seconds > 0"),
    ("dist", "start -n 2 --timeout -5", "--timeout must be a number of seconds > 0"),
    ("dist", "start -n 2 --timeout soon", "--timeout must be a number of seconds"),
    ("dist", "start -n 2 --launcher pigeon", "unknown launcher 'pigeon'"),
    ("dist", "start -n __import__('os').getpid()", "-n must be a whole number"),  # never evaluated
    ("dist", "stacks", "no lab is running: start one with %dist start -n 2"),
    ("dist", "profile --steps 3", "no lab is running"),
    ("dist", "profile --steps 0", "--steps must be >= 1"),
    ("dist", "start -n 2 --nodes 0", "--nodes must be >= 1"),
    ("dist", "start -n 2 --nodes two", "--nodes must be a whole number"),
    ("dist", "start -n 2 --nodes 3", "--nodes 3 is more nodes than ranks (-n 2)"),
    ("dist", "start -n 2 --nodes 2 --link fast", "--link must be a bandwidth with a unit, like --link 1gbit"),
    ("dist", "start -n 2 --nodes 2 --link 1gbit --latency=-1ms", "--latency must be >= 0"),
    ("dist", "start -n 2 --nodes 2 --link 1gbit --latency soon", "--latency must be a time with a unit"),
    (
        "dist", "start -n 2 --link 1gbit",
        "--link sets the network between nodes: give --nodes too, like --nodes 2 --link",
    ),
    ("dist", "start -n 2 --nodes 2 --launcher mpi", "--nodes starts the ranks in namespaces"),
    ("dist", "start -n 4 --racks 2", "--racks sets the network between nodes: give --nodes too"),
    ("dist", "start -n 4 --nodes 2 --uplink 1gbit", "--uplink joins racks to the spine: give --racks too"),
    ("dist", "start -n 4 --nodes 2 --racks 3", "--racks 3 is more racks than nodes (--nodes 2)"),
    ("dist", "start -n 4 --nodes 4 --racks 1", "--racks must be >= 2"),
    ("dist", "start -n 4 --nodes 4 --racks 2 --uplink quick", "--uplink must be a bandwidth with a unit"),
    ("dist", "link 1gbit", "no lab is running"),
    ("dist", "launch", "unknown subcommand 'launch'"),
    ("dist", "", "%dist needs a subcommand"),
    ("dist", "status", "no lab is running"),
    ("dist", "restart", "no lab is running"),
    ("dist", "kill 1", "no lab is running"),
    ("dist", "run train.py --epochs 2", "no lab is running"),
    ("dist", "run", "%dist run needs a script: %dist run train.py [ARGS...]"),
    ("dist", "export train.py", "no lab is running"),
    ("ddp", "", "no lab is running"),
    ("quiz", "nope", "unknown topic 'nope'; choose one of: why-distribute"),
    ("quiz", "scaling -n 0", "-n must be >= 1"),
    ("quiz", "scaling --difficulty impossible", "unknown difficulty 'impossible'"),
]

BAD_WHILE_RUNNING = [
    ("dist", "start -n 2", "already running"),
    ("dist", "kill 7", "rank 7 does not exist in a world of 2"),
    ("dist", "kill x", "the rank must be a whole number"),
    ("dist", "status now", "unrecognized arguments"),
    ("ddp", "-r 2", "rank 2 does not exist in a world of 2"),
    ("ddp", "-r 0-", "not a rank or a range"),
    ("ddp", "-r 1-0", "runs backwards"),
    ("ddp", "--timeout 0", "--timeout must be a number of seconds > 0"),
    ("dist", "restart -n 0", "-n must be >= 1"),
    ("dist", "restart -n two", "-n must be a whole number"),
    ("dist", "restart now", "unrecognized arguments"),
    ("dist", "link 100mbit", "%dist link needs a lab on emulated nodes"),
    ("dist", "run no-such-script.py --epochs 2", "no such file: no-such-script.py"),
    ("dist", "run --timeout 0 train.py", "--timeout must be a number of seconds > 0"),
    ("dist", "export /no/such/folder/train.py", "the folder /no/such/folder does not exist"),
    ("dist", "export", "the following arguments are required: file"),
    ("dist", "export a.py b.py", "unrecognized arguments"),
    ("dist", "export no-cell-yet.py", "no cell has run on every rank yet: there is nothing to export"),
    ("dist", "stacks 5", "rank 5 does not exist in a world of 2"),
    ("dist", "stacks 0 1", "unrecognized arguments"),
    ("dist", "stacks --deep", "unrecognized arguments"),
    ("dist", "profile --steps two", "--steps must be a whole number"),
    ("dist", "profile --warmup=-1", "--warmup must be >= 0"),
]

BAD_ON_NODES = [
    ("dist", "link fast", "--link must be a bandwidth with a unit"),
    ("dist", "link --latency 1ms", "--latency delays a shaped link: give a rate too"),
    ("dist", "link 1gbit --latency=-2ms", "--latency must be >= 0"),
    ("dist", "restart -n 1", "--nodes 2 is more nodes than ranks (-n 1)"),
    ("dist", "link 1gbit 2gbit", "unrecognized arguments"),
    ("dist", "link --uplink 1gbit", "--uplink joins racks to the spine: give --racks too"),
]


def _call(ip, magic: str, line: str):
    if magic == "ddp":
        return ip.run_cell_magic("ddp", line, "print('should not run')")
    return ip.run_line_magic(magic, line)


@pytest.mark.parametrize("magic, line, fragment", BAD_BEFORE_START)
def test_bad_input_before_start_gets_one_line_and_starts_nothing(ipython, magic, line, fragment):
    before = {p.pid for p in distlab_processes()}
    with pytest.raises(UsageError) as info:
        _call(ipython, magic, line)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
    assert {p.pid for p in distlab_processes()} <= before
    assert distlab.front.magics._registered[id(ipython)].lab is None


@pytest.mark.cluster
def test_bad_input_while_running_gets_one_line_and_changes_nothing(ipython, capsys):
    ipython.run_line_magic("dist", "start -n 2")
    lab = distlab.front.magics._registered[id(ipython)].lab
    table = [(r.rank, r.pid) for r in lab.status()]
    capsys.readouterr()
    for magic, line, fragment in BAD_WHILE_RUNNING:
        with pytest.raises(UsageError) as info:
            _call(ipython, magic, line)
        assert fragment in str(info.value), (line, str(info.value))
        assert "\n" not in str(info.value)
    assert "should not run" not in capsys.readouterr().out
    assert [(r.rank, r.pid) for r in lab.status()] == table
    assert all(r.health == "ok" for r in lab.status())


@pytest.mark.cluster
def test_a_ddp_cell_trains_and_streams_each_ranks_prints(ipython, capsys):
    ipython.run_line_magic("dist", "start -n 2")
    ipython.run_cell_magic(
        "ddp",
        "",
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\n"
        "model = DDP(torch.nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(3):\n"
        "    opt.zero_grad()\n"
        "    loss = model(torch.randn(8, 4) + rank).pow(2).mean()\n"
        "    loss.backward(); opt.step()\n"
        "    print(f'step {step} loss {loss.item():.3f}')\n"
        "float(model.module.weight.sum())",
    )
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert sum(line.startswith(f"[rank {rank}] step ") for line in out.splitlines()) == 3
    outs = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("Out[rank ")]
    assert len(outs) == 2 and outs[0] == outs[1]  # DDP kept the replicas identical


@pytest.mark.cluster
def test_a_ddp_cell_is_linted_before_it_runs_and_strict_refuses_it(ipython, capsys):
    ipython.run_line_magic("dist", "start -n 2")
    # Every rank of 2 takes this branch, so it runs; the lint cannot know the world is that small.
    cell = "t = torch.ones(1)\nif rank < 2:\n    dist.all_reduce(t)\nprint('summed', t.item())\n"
    ipython.run_cell_magic("ddp", "", cell)
    shown = capsys.readouterr()
    assert shown.err.count("distlab lint: ") == 1
    assert "distlab lint: line 3: dist.all_reduce is called only where 'rank < 2' is true (line 2)" in shown.err
    assert "[ranks 0-1] summed 2.0" in shown.out  # it ran anyway
    with pytest.raises(UsageError) as info:
        ipython.run_cell_magic("ddp", "--strict", cell.replace("'summed'", "'strict summed'"))
    assert "--strict: nothing ran" in str(info.value) and "\n" not in str(info.value)
    shown = capsys.readouterr()
    assert "distlab lint: line 3" in shown.err and "strict summed" not in shown.out
    ipython.run_cell_magic("ddp", "--strict", "t = torch.ones(1)\ndist.all_reduce(t)\nprint('clean', t.item())")
    assert "[ranks 0-1] clean 2.0" in capsys.readouterr().out


@pytest.mark.cluster
def test_auto_mode_runs_plain_cells_on_the_ranks_across_a_restart_until_turned_off_or_stopped(ipython, capsys):
    with pytest.raises(UsageError, match=r"^auto mode runs cells on a lab, and none is running: %dist start"):
        ipython.run_line_magic("dist", "auto on")
    with pytest.raises(distlab.LabUsageError, match="none is running"):
        distlab.auto(True)
    ipython.run_line_magic("dist", "start -n 2")
    with pytest.raises(UsageError, match="%dist auto takes on or off, got maybe"):
        ipython.run_line_magic("dist", "auto maybe")
    ipython.run_line_magic("dist", "auto on")
    capsys.readouterr()
    ipython.run_cell("placed = f'on rank {rank}'\nprint(placed)\n")
    out = capsys.readouterr().out
    assert "(auto: on 2 ranks" in out and "[rank 0] on rank 0" in out and "[rank 1] on rank 1" in out
    assert "placed" not in ipython.user_ns
    ipython.run_cell("%%local\nhere = 41 + 1\nprint('local', here)\n")
    assert ipython.user_ns["here"] == 42 and "[rank" not in capsys.readouterr().out
    assert [r.rank for r in ipython.run_cell("%dist status").result] == [0, 1]  # a magic stays here
    ipython.run_line_magic("dist", "restart")
    ipython.run_cell("print('after restart', rank)\n")
    assert "[rank 1] after restart 1" in capsys.readouterr().out
    distlab.auto(False)
    ipython.run_cell("plain = 7\n")
    assert ipython.user_ns["plain"] == 7
    distlab.auto(True)
    ipython.run_line_magic("dist", "stop")
    assert "auto mode off" in capsys.readouterr().out
    ipython.run_cell("after_stop = 8\n")
    assert ipython.user_ns["after_stop"] == 8  # a stop leaves the notebook's cells on the notebook


@pytest.mark.cluster
def test_status_subset_restart_and_stop_through_the_magics(ipython, capsys):
    ipython.run_line_magic("dist", "start -n 2")
    table = ipython.run_line_magic("dist", "status")
    assert [r.rank for r in table] == [0, 1]
    ipython.run_cell_magic("ddp", "-r 1", "print('only me')")
    out = capsys.readouterr().out
    assert "[rank 1] only me" in out and "[rank 0]" not in out
    ipython.run_line_magic("dist", "restart")
    assert {r.pid for r in ipython.run_line_magic("dist", "status")}.isdisjoint({r.pid for r in table})
    ipython.run_line_magic("dist", "stop")
    with pytest.raises(UsageError, match="no lab is running"):
        ipython.run_cell_magic("ddp", "", "pass")


@pytest.mark.cluster
def test_a_failing_cell_shows_one_grouped_traceback(ipython, capsys):
    ipython.run_line_magic("dist", "start -n 2")
    result = ipython.run_cell("%%ddp\nvalues = [1, 2]\nvalues[5]\n")
    assert isinstance(result.error_in_exec, distlab.RankError)
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert "ranks 0-1: IndexError: list index out of range" in text
    assert text.count("Traceback") == 1
    assert "CompositeError" not in text



def test_quiz_magic_shows_questions_of_the_topic_and_a_summary_without_one(ipython):
    from distlab.quiz.widget import QuizWidget

    widget = ipython.run_line_magic("quiz", "communication-cost -n 2 --difficulty medium")
    assert isinstance(widget, QuizWidget)
    assert "Communication cost" in widget.children[0].value and "of 2" in widget.children[0].value
    summary = ipython.run_line_magic("quiz", "")
    assert "communication-cost" in repr(summary)
    # every exercise of the course, checked or not (none is, in this test's progress file)
    from distlab.exercises.catalog import EXERCISES

    assert [row.name for row in summary.exercises] == list(EXERCISES)
    assert f"Exercises: 0 of {len(EXERCISES)} passed" in str(summary)


def test_quiz_magic_with_a_seed_asks_the_same_questions_each_time(ipython):
    def asked(seed: int) -> list[str]:
        return [q.id for q in ipython.run_line_magic("quiz", f"data-parallelism -n 3 --seed {seed}").questions]

    assert asked(1) == asked(1)
    assert any(asked(1) != asked(seed) for seed in range(2, 6))


@pytest.mark.cluster
def test_a_lab_on_nodes_from_the_magics_and_its_link_changed_between_cells(ipython, capsys):
    from distlab.cluster.nodes import netem_missing

    ipython.run_line_magic("dist", "start -n 2 --nodes 2 --link 100mbit")
    assert "2 ranks ready on 2 nodes (link 100mbit)" in capsys.readouterr().out
    lab = distlab.front.magics._registered[id(ipython)].lab
    shown = str(ipython.run_line_magic("dist", "status"))
    assert "node0" in shown and "node1" in shown and "link 100mbit" in shown
    ipython.run_line_magic("dist", "link 200mbit")
    assert "link: 200mbit" in capsys.readouterr().out and lab.link.rate_bps == 200_000_000
    table = [(r.rank, r.pid) for r in lab.status()]
    bad = list(BAD_ON_NODES)
    if netem_missing() is not None:
        bad.append(("dist", "link 1gbit --latency 1ms", "needs the kernel's netem queue"))
    for magic, line, fragment in bad:
        with pytest.raises(UsageError) as info:
            _call(ipython, magic, line)
        assert fragment in str(info.value), (line, str(info.value))
        assert "\n" not in str(info.value)
    assert str(lab.link) == "200mbit" and [(r.rank, r.pid) for r in lab.status()] == table
    ipython.run_line_magic("dist", "link off")
    assert "link: not shaped" in capsys.readouterr().out and lab.link is None


@pytest.mark.cluster
def test_break_step_and_continue_through_the_magics(ipython, capsys):
    ipython.run_line_magic("dist", "start -n 2")
    for bad, says in [("break", "needs a collective"), ("break at=x", "at='x' is not an int"),
                      ("break color=red", "does not take 'color=red'"), ("break 0", "from 1"),
                      ("step", "nothing is paused")]:
        with pytest.raises(UsageError, match=re.escape(says)) as info:
            ipython.run_line_magic("dist", bad)
        assert "\n" not in str(info.value)
    ipython.run_line_magic("dist", "break 2 op=all_reduce")
    capsys.readouterr()
    cell = "t = torch.ones(2)\ndist.all_reduce(t)\ndist.all_reduce(t)\nprint('summed', t.sum().item())\nt.sum().item()"
    ipython.run_cell_magic("ddp", "", cell)
    out = capsys.readouterr().out
    assert "paused before collective 2 of the cell: all_reduce on default_pg" in out and "summed" not in out
    ipython.run_line_magic("dist", "step")
    out = capsys.readouterr().out
    assert "the cell ended" in out and "[ranks 0-1] summed 8.0" in out
    ipython.run_line_magic("dist", "break 1")
    ipython.run_line_magic("dist", "break off")
    ipython.run_cell_magic("ddp", "", cell)
    assert "Out[rank 0]: 8.0" in capsys.readouterr().out  # disarmed: it ran through
    ipython.run_line_magic("dist", "break 1")
    ipython.run_cell_magic("ddp", "", cell)
    ipython.run_line_magic("dist", "continue")
    assert "Out[rank 1]: 8.0" in capsys.readouterr().out
    ipython.run_line_magic("dist", "stop")
