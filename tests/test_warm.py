"""Warm ranks: local labs fork their engines and controller from one template that has imported
torch; nothing they fork outlives its lab, and the template does not outlive its notebook."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from conftest import distlab_processes

from distlab.cluster import warm
from distlab.cluster.processes import pid_alive, wait_for

pytestmark = pytest.mark.cluster


def _environment(pid: int) -> dict[str, str]:
    """A process's environment as the kernel shows it. Popen returns when exec has closed the
    error pipe, a moment before the kernel records where the new environment lies: read then,
    /proc/PID/environ is empty (seen 2 times in 60 back-to-back starts)."""
    proc = psutil.Process(pid)
    assert wait_for(lambda: bool(proc.environ()), 10), f"process {pid} shows no environment"
    return proc.environ()


def _template_children(template_pid: int) -> list[psutil.Process]:
    return psutil.Process(template_pid).children(recursive=True)


def test_a_labs_engines_and_controller_are_forked_from_the_template_and_say_what_they_are(lab_factory):
    lab = lab_factory(ranks=2)
    template = warm.current(os.environ)
    forked = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(template.pid).children()}
    engines = [row.pid for row in lab.status()]
    assert set(engines) <= set(forked), (engines, forked)
    assert all("-m distlab.rank.engine_main" in forked[pid] for pid in engines), forked
    assert any("-m ipyparallel.controller" in cmd for cmd in forked.values()), forked
    # Each engine is a session of its own, as ipyparallel's launcher makes it, with its nanny under it.
    for pid in engines:
        assert os.getsid(pid) == pid
        nannies = [" ".join(c.cmdline()) for c in psutil.Process(pid).children()]
        assert any("ipyparallel.engine.nanny" in cmd for cmd in nannies), nannies
    # The forked world is a working one.
    out = lab.run("t = torch.ones(1); dist.all_reduce(t); print(int(t.item()))", stream=False)
    assert {r: text.strip() for r, text in out.stdout.items()} == {0: "2", 1: "2"}


# What a rank's process has between cells (evaluated by ipyparallel, not distlab's cell runner,
# which handles SIGINT itself while a cell runs): its signal dispositions, its next random draws.
_STATE = (
    # SIGINT, SIGCHLD, SIGPIPE
    "{'value': [getattr(d, '__name__', str(d)) for d in map(__import__('signal').getsignal, (2, 17, 13))]"
    " + [str(__import__('random').random()), str(__import__('numpy').random.random())]}"
)


def _states(lab) -> list[list[str]]:
    found = lab.call(lambda engine, rank: engine.apply_async(eval, _STATE))
    return [found[rank] for rank in sorted(found)]


def test_a_forked_rank_starts_as_a_fresh_python_would_its_signals_and_random_draws_its_own(lab_factory, monkeypatch):
    warm_lab = lab_factory(ranks=2)
    first = _states(warm_lab)
    warm_lab.restart()
    again = _states(warm_lab)
    monkeypatch.setenv("DISTLAB_WARM", "0")
    cold = _states(lab_factory(ranks=2))
    # Between cells SIGINT raises KeyboardInterrupt (it interrupts a cell), as on a rank started cold.
    assert cold[0][0] == "default_int_handler", cold
    assert [row[:3] for row in first + again] == [cold[0][:3]] * 4, (first, again, cold)
    # Python's and numpy's random numbers differ between the ranks and between restarts.
    draws = [row[3:] for row in first + again]
    for column in (0, 1):
        assert len({draw[column] for draw in draws}) == 4, draws


def test_a_forked_rank_has_torchdynamo_before_its_first_optimizer_and_a_ddp_model_trains_there(lab_factory):
    # TorchDynamo is what a rank imports at its first optimizer or DDP model: the template imported it once.
    lab = lab_factory(ranks=2)
    assert lab.run("import sys; 'torch._dynamo' in sys.modules", stream=False) == {0: True, 1: True}
    trained = lab.run(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\n"
        "model = DDP(torch.nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.randn(8, 4) + rank).pow(2).mean().backward()\n"
        "opt.step()\n"
        "model.module.weight.sum().item()",
        stream=False,
    )
    assert trained[0] == trained[1]  # the gradients were averaged: the replicas stayed equal


def test_a_rank_imports_the_notebooks_own_modules_from_where_the_lab_started(lab_factory, tmp_path, monkeypatch):
    warm.current(os.environ).wait_ready()  # started in another directory
    (tmp_path / "learners_helpers.py").write_text("ANSWER = 42\n")
    monkeypatch.chdir(tmp_path)
    lab = lab_factory(ranks=2)
    out = lab.run("import os, learners_helpers; print(learners_helpers.ANSWER, os.getcwd())", stream=False)
    assert {text.strip() for text in out.stdout.values()} == {f"42 {tmp_path}"}


def test_a_rank_sees_the_environment_of_its_labs_start_not_the_templates(lab_factory, monkeypatch):
    warm.current(os.environ).wait_ready()  # the template started before the variable was set
    monkeypatch.setenv("DISTLAB_TEST_VALUE", "set after the template")
    lab = lab_factory(ranks=2)
    out = lab.run("import os; print(os.environ.get('DISTLAB_TEST_VALUE'))", stream=False)
    assert {text.strip() for text in out.stdout.values()} == {"set after the template"}


def test_nothing_a_lab_forked_outlives_it_and_the_template_serves_the_next_lab(lab_factory):
    template = warm.current(os.environ)
    template.wait_ready()
    # Other labs of this run (a shared one, a module's), forked or not, are not this test's.
    others = {p.pid for p in _template_children(template.pid)} | {p.pid for p in distlab_processes()}
    first = lab_factory(ranks=2)
    forked = [p for p in _template_children(template.pid) if p.pid not in others]
    assert len(forked) >= 5, forked  # controller (and its schedulers), 2 engines, 2 nannies
    first.stop()
    _, alive = psutil.wait_procs(forked, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline() for p in alive]
    assert not {p.pid for p in distlab_processes()} - others
    second = lab_factory(ranks=3)
    assert warm.current(os.environ).pid == template.pid
    assert {row.pid for row in second.status()} <= {p.pid for p in psutil.Process(template.pid).children()}


def test_a_restart_forks_a_new_world(lab_factory):
    lab = lab_factory(ranks=2)
    before = {row.pid for row in lab.status()}
    lab.restart(ranks=3)
    after = {row.pid for row in lab.status()}
    assert len(after) == 3 and not before & after
    assert wait_for(lambda: not any(pid_alive(pid) for pid in before), 10)  # ended beside the new world
    children = {p.pid for p in psutil.Process(warm.current(os.environ).pid).children()}
    assert after <= children


def test_a_change_to_what_torch_reads_at_import_gets_a_new_template_and_the_old_one_ends(monkeypatch):
    old = warm.current(os.environ)
    old.wait_ready()
    monkeypatch.setenv("OMP_NUM_THREADS", "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2")
    new = warm.current(os.environ)
    try:
        assert new.pid != old.pid
        assert wait_for(lambda: not pid_alive(old.pid), 10)
        assert _environment(new.pid)["OMP_NUM_THREADS"] == os.environ["OMP_NUM_THREADS"]
        # A launcher's environment that is not the notebook's gets a template made from it, kept for the next ask.
        launchers = {**os.environ, "OMP_NUM_THREADS": "3"}
        made = warm.current(launchers)
        assert _environment(made.pid)["OMP_NUM_THREADS"] == "3"
        assert warm.current(launchers) is made
    finally:
        monkeypatch.undo()
        warm.current(os.environ)  # back to one for this run's environment


def test_a_template_that_died_is_replaced(lab_factory):
    template = warm.current(os.environ)
    template.wait_ready()
    os.kill(template.pid, signal.SIGKILL)
    assert wait_for(lambda: not template.alive(), 10)
    lab = lab_factory(ranks=2)
    assert warm.current(os.environ).pid != template.pid
    assert lab.run("print(dist.get_world_size())", stream=False).stdout[1].strip() == "2"


def test_with_distlab_warm_0_engines_start_cold(lab_factory, monkeypatch):
    monkeypatch.setenv("DISTLAB_WARM", "0")
    lab = lab_factory(ranks=2)
    for row in lab.status():
        proc = psutil.Process(row.pid)
        assert "distlab.rank.warm_template" not in " ".join(psutil.Process(proc.ppid()).cmdline())


def test_the_template_and_everything_forked_end_when_the_notebook_process_is_killed(tmp_path):
    script = textwrap.dedent(
        """
        import sys, distlab
        lab = distlab.start(ranks=2)
        print(" ".join(str(r.pid) for r in lab.status()), flush=True)
        sys.stdin.readline()  # killed here
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        engines = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(engines) == 2
        everything = psutil.Process(proc.pid).children(recursive=True)
        assert any("distlab.rank.warm_template" in " ".join(p.cmdline()) for p in everything)
        proc.kill()
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs(everything, timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_template_still_importing_ends_as_soon_as_its_notebook_process_is_killed(tmp_path):
    # A machine so loaded that the template's imports take minutes: one of them sleeps (the
    # template reads its stdin, and so sees its notebook's end, only once they are done).
    importing = tmp_path / "importing"
    (tmp_path / "setproctitle.py").write_text(f"import time\nopen({str(importing)!r}, 'w').close()\ntime.sleep(300)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    script = textwrap.dedent(
        """
        import os, sys
        from distlab.cluster import warm
        print(warm.current(os.environ).pid, flush=True)
        sys.stdin.readline()  # killed here
        """
    )
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, **pipes)
    try:
        assert proc.stdout is not None
        template = psutil.Process(int(proc.stdout.readline()))
        assert wait_for(importing.exists, 120), "the template never reached its imports"
        proc.kill()
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs([template], timeout=30)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], template.cmdline()
    finally:
        if proc.poll() is None:
            proc.kill()
