"""A class's limits in a learner's kernel (``distlab.classroom.limits``): their text, the refusals
before a lab starts or grows, and the idle end."""

from __future__ import annotations

import os

import pytest
from conftest import distlab_processes, python_lines

from distlab.classroom.limits import ENV_VAR, ClassLimits, Limits
from distlab.cluster.processes import pid_alive, wait_for
from distlab.errors import LabUsageError
from distlab.front.lab import Lab
from distlab.notebook.core import LabCore
from distlab.server import registry

# ---------------------------------------------------------------------------- the text


@pytest.mark.parametrize(("text", "limits"), [
    ("ranks=4,labs=2,cores=1.5,idle=30m", Limits(ranks=4, labs=2, cores=1.5, idle_s=1800.0)),
    (" ranks = 8 , idle=2h ,", Limits(ranks=8, idle_s=7200.0)),
    ("idle=90", Limits(idle_s=90.0)),
    ("idle=1.5m,cores=2", Limits(cores=2.0, idle_s=90.0)),
    ("idle=3s", Limits(idle_s=3.0)),
    ("cores=1,cores=1", Limits(cores=1.0)),  # the hub may join the instructor's text and its own cores
    ("", Limits()),
])
def test_limits_are_read_from_their_text_and_written_back_as_text_that_reads_the_same(text, limits):
    assert Limits.parse(text) == limits
    assert Limits.parse(str(limits)) == limits
    assert Limits.parse(limits.to_env()) == limits


def test_the_written_text_is_the_short_form():
    assert str(Limits(ranks=4, labs=2, cores=1.5, idle_s=1800.0)) == "ranks=4,labs=2,cores=1.5,idle=30m"
    assert str(Limits(idle_s=7200.0)) == "idle=2h"
    assert str(Limits(idle_s=90.0)) == "idle=90s"


@pytest.mark.parametrize(("text", "named"), [
    ("ranks=0", "ranks='0'"), ("ranks=two", "ranks='two'"), ("ranks=2.5", "ranks='2.5'"), ("labs=-1", "labs='-1'"),
    ("cores=0", "cores='0'"), ("cores=lots", "cores='lots'"), ("cores=nan", "cores='nan'"),
    ("idle=5x", "idle='5x'"), ("idle=0", "idle='0'"), ("idle=m", "idle='m'"), ("idle=", "'idle='"),
    ("ranks", "'ranks'"), ("gpus=2", "'gpus'"), ("ranks=2,ranks=3", "'ranks' is given twice"),
])
def test_wrong_text_is_one_line_naming_the_key_or_value_and_the_form(text, named):
    with pytest.raises(ValueError) as wrong:
        Limits.parse(text)
    message = str(wrong.value)
    assert isinstance(wrong.value, LabUsageError)  # the magics show it as one line
    assert "\n" not in message and named in message, message
    assert 'the form is "ranks=4,labs=2,cores=1.5,idle=30m"' in message, message


def test_the_environment_gives_the_limits_or_none_and_wrong_text_names_the_variable(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert Limits.from_env() is None
    monkeypatch.setenv(ENV_VAR, "  ")
    assert Limits.from_env() is None
    monkeypatch.setenv(ENV_VAR, "ranks=4,idle=30m")
    assert Limits.from_env() == Limits(ranks=4, idle_s=1800.0)
    monkeypatch.setenv(ENV_VAR, "ranks=four")
    with pytest.raises(LabUsageError, match=f"^{ENV_VAR} \\(set by the class's hub\\) is wrong: limit ranks='four'"):
        Lab(ranks=1)  # refused before anything starts


def test_the_learners_labs_are_counted_from_their_state_files_and_a_lab_over_a_limit_is_refused(
    tmp_path, monkeypatch
):
    # Two labs of another kernel of this learner (this process stands in for it: a live pid).
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    for name, ranks in (("lab-1-a", 2), ("lab-1-b", 1)):
        registry._write(registry.registry_dir() / f"{name}.json", {"pid": os.getpid(), "world_size": ranks})
    new = LabCore(ranks=2)
    with pytest.raises(LabUsageError) as refused:
        ClassLimits(Limits(ranks=4)).check_start(new)
    assert str(refused.value) == (
        "2 more ranks would make 5 running, over this class's limit of 4 ranks per learner: "
        "stop a lab (%dist stop) or start fewer ranks"
    )
    ClassLimits(Limits(ranks=5)).check_start(new)  # exactly at the limit: allowed
    with pytest.raises(LabUsageError) as refused:
        ClassLimits(Limits(labs=2)).check_start(new)
    assert str(refused.value) == (
        "this class allows 2 running labs per learner, and 2 are running (lab-1-a, lab-1-b): stop one with %dist stop"
    )
    with pytest.raises(LabUsageError) as refused:
        ClassLimits(Limits(ranks=4)).check_start(LabCore(ranks=6))
    assert str(refused.value) == (
        "6 ranks is over this class's limit of 4 ranks per learner: use at most 4 (%dist start -n 4)"
    )


# ---------------------------------------------------------------------------- on real labs


@pytest.fixture
def in_class(tmp_path, monkeypatch):
    """Set the class's limits (``in_class("ranks=3")``), with this test's own state files."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))

    def limits(text: str) -> None:
        monkeypatch.setenv(ENV_VAR, text)

    return limits


@pytest.mark.cluster
def test_ranks_over_the_classs_limit_are_refused_before_any_process_starts(in_class, lab_factory):
    in_class("ranks=3")
    first = lab_factory(ranks=2, spares=0)  # no spare engines: none start in the background to be counted
    (entry,) = registry.read_labs()
    assert isinstance(entry["started"], float) and entry["last_cell"] is None
    first.run("x = 1", stream=False)
    (entry,) = registry.read_labs()
    assert entry["last_cell"] >= entry["started"]  # the instructor's view reads "idle" from it

    before = {p.pid for p in distlab_processes()}
    second = Lab(ranks=2)
    with pytest.raises(LabUsageError) as refused:
        second.start()
    assert str(refused.value) == (
        "2 more ranks would make 4 running, over this class's limit of 3 ranks per learner: "
        "stop a lab (%dist stop) or start fewer ranks"
    )
    assert not second.running
    assert {p.pid for p in distlab_processes()} == before  # nothing started, nothing left
    with pytest.raises(LabUsageError) as refused:
        first.restart(ranks=4)
    assert str(refused.value) == (
        "4 ranks is over this class's limit of 3 ranks per learner: use at most 3 (%dist restart -n 3)"
    )

    third = lab_factory(ranks=1, spares=0)  # 3 running: at the limit, not over it
    for lab in (first, third):  # growing a lab counts the others' ranks
        with pytest.raises(LabUsageError, match=r"^1 more rank would make 4 running"):
            lab.restart(ranks=lab.world_size + 1)
    assert first.run("x", stream=False) == {0: 1, 1: 1} and third.world_size == 1
    assert len(registry.read_labs()) == 2


@pytest.mark.cluster
def test_a_second_lab_over_the_classs_limit_of_labs_is_refused_by_the_magic_in_one_line(
    in_class, lab_factory, ipython
):
    from IPython.core.error import UsageError

    in_class("labs=1")
    first = lab_factory(ranks=1, spares=0)  # no spare engines: none start in the background to be counted
    before = {p.pid for p in distlab_processes()}
    with pytest.raises(UsageError) as refused:
        ipython.run_line_magic("dist", "start -n 1")
    assert str(refused.value) == (
        f"this class allows 1 running lab per learner, and 1 is running ({registry.id_of(first)}): "
        "stop one with %dist stop"
    )
    assert {p.pid for p in distlab_processes()} == before


@pytest.mark.cluster
def test_an_idle_lab_is_stopped_but_never_while_a_cell_longer_than_the_idle_limit_runs(in_class, lab_factory, capsys):
    in_class("idle=3s")
    before = {p.pid for p in distlab_processes()}
    lab = lab_factory(ranks=1)
    pids = [r.pid for r in lab.table]
    assert lab.run("import time; time.sleep(6); 'done'", stream=False) == {0: "done"}
    assert lab.running  # idle counts from the cell's end
    assert wait_for(lambda: not lab.running, 60), "the idle lab was not stopped"
    assert wait_for(lambda: not any(pid_alive(pid) for pid in pids), 30)
    # The stop runs in the idle watch's thread: its processes go first, and the lab's panel file
    # is removed at its very end, after which the line is printed. Wait for the line, then look.
    line = f"[distlab] lab {registry.id_of(lab)} stopped: no cell for 3s, this class's idle limit"
    assert wait_for(lambda: line in capsys.readouterr().out, 30)
    assert wait_for(lambda: not {p.pid for p in distlab_processes()} - before, 30), distlab_processes()
    assert registry.read_labs() == []
    with pytest.raises(LabUsageError, match="no lab is running"):
        lab.run("1", stream=False)


@pytest.mark.cluster
def test_a_lab_outside_a_class_imports_nothing_of_the_classs_limits():
    code = (
        "import os, sys; os.environ.pop('DISTLAB_LIMITS', None)\n"
        "from distlab.front.lab import Lab\n"
        "Lab(ranks=1)\n"
        "print('distlab.classroom.limits' in sys.modules, 'distlab.classroom' in sys.modules)\n"
    )
    assert python_lines(code, 120) == ["False False"]
