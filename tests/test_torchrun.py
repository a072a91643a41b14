"""Code written for torchrun runs in the lab as it is, and what ran in the lab leaves it as a torchrun script.

- a cell's (or a script's) ``init_process_group`` joins the lab's group, ``destroy_process_group()``
  leaves it up, a call that cannot mean the lab's group is one clear error (``rank/torchrun.py``);
- every rank has torchrun's variables;
- ``%dist run`` / ``lab.run_script`` runs a torchrun script on every rank as ``__main__``;
- ``%dist export`` / ``lab.export`` writes the cells run so far as a script that real torchrun runs,
  to the same weights, bit for bit.

The tests without a lab (the checks, the script's text) are in the fast tier; the others share one
2-rank lab for the module.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import distlab
import distlab.front.magics
from distlab.errors import LabUsageError, RankError
from distlab.front.lab import Lab
from distlab.notebook.script import CellRan, Pushed, Restarted, ScriptRan, build_script
from distlab.wire import GroupSpec

cluster = pytest.mark.cluster

SETUP_SCRIPT = textwrap.dedent('''\
    """A torchrun script as tutorials write it: setup(), the work, cleanup()."""
    import os
    import sys

    import torch
    import torch.distributed as dist


    def setup():
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


    def cleanup():
        dist.destroy_process_group()


    def main():
        setup()
        rank = dist.get_rank()
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        print(f"rank {rank} of {dist.get_world_size()}: sum {total.item():g}, argv {sys.argv[1:]}, "
              f"local rank {os.environ['LOCAL_RANK']}")
        cleanup()


    if __name__ == "__main__":
        main()
''')


# ------------------------------------------------------------------------------ fast: no lab


def _spec(rank: int = 0, world_size: int = 2, backend: str = "gloo", **more: object) -> GroupSpec:
    return GroupSpec(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                     master_addr="127.0.0.1", master_port=41234, backend=backend, timeout_s=30, **more)


@pytest.mark.parametrize("backend, world_size, rank", [
    (None, -1, -1),
    ("gloo", 2, 0),
    ("GLOO", None, None),
    ("cpu:gloo,cuda:nccl", 2, -1),
    ("cpu:gloo", -1, 0),
])
def test_a_call_that_can_mean_the_labs_group_matches_it(backend, world_size, rank):
    from distlab.rank.torchrun import mismatch

    assert mismatch(backend, world_size, rank, _spec()) is None


@pytest.mark.parametrize("backend, world_size, rank, lab, fragment", [
    ("gloo", 4, -1, _spec(), ("init_process_group(world_size=4) but this lab has 2 ranks: start the lab with "
                              "%dist start -n 4")),
    ("gloo", 4, -1, _spec(), "or pass world_size=2"),
    (None, -1, 1, _spec(rank=0), "init_process_group(rank=1) but this is rank 0 of the lab"),
    ("nccl", -1, -1, _spec(), ("init_process_group('nccl') but this lab's process group is gloo, on CPU ranks "
                               "(NCCL needs GPUs): pass 'gloo', or leave the backend out")),
    ("cuda:nccl", -1, -1, _spec(), "names no backend for cpu tensors"),
    ("gloo", -1, -1, _spec(backend="nccl"), "start the lab with %dist start --backend gloo"),
    ("mpi", -1, -1, _spec(), "a lab runs gloo or nccl"),
])
def test_a_call_that_cannot_mean_the_labs_group_says_what_differs_and_what_to_change(
    backend, world_size, rank, lab, fragment
):
    from distlab.rank.torchrun import mismatch

    problem = mismatch(backend, world_size, rank, lab)
    assert problem is not None and fragment in problem and "\n" not in problem


def test_a_rank_the_cell_rebound_is_named_as_the_cause_of_the_mismatch():
    from distlab.rank.torchrun import mismatch

    problem = mismatch("gloo", 2, 1, _spec(rank=0), rebound=["rank"])
    assert problem is not None and "\n" not in problem
    assert problem.startswith("init_process_group(rank=1) but this is rank 0 of the lab (this cell rebound distlab's "
                              "rank to 1, as a launcher's loop `for rank in range(size)` does")
    assert "rebound" not in (mismatch("gloo", 2, 1, _spec(rank=0)) or "")  # not said when it was not so


def test_what_torchrun_refuses_or_hangs_on_is_named_with_what_to_change():
    import torch

    from distlab.rank.torchrun import torchrun_differences

    lab, environ = _spec(), {"MASTER_PORT": "41234"}
    for device_id in (torch.device("cpu"), torch.device("cuda")):
        said = torchrun_differences({"device_id": device_id}, lab, environ)
        assert len(said) == 1 and "under torchrun torch raises ValueError (device_id must be an accelerator with " \
            "an index): leave device_id out on the CPU" in said[0]
    assert torchrun_differences({"device_id": torch.device("cuda", 0), "backend": "gloo"}, lab, environ) == []
    fixed = torchrun_differences({}, lab, {"MASTER_PORT": "12355"})
    assert len(fixed) == 1 and fixed[0].startswith(
        "MASTER_PORT is 12355 here, set by this code (the lab's is 41234): under torchrun every process would wait "
        "on port 12355 for a store nobody serves there")
    assert "os.environ.setdefault('MASTER_PORT', '12355')" in fixed[0] and "\n" not in fixed[0]
    assert torchrun_differences({"init_method": "tcp://10.0.0.1:1"}, lab, {"MASTER_PORT": "12355"}) == []


def test_torchruns_variables_name_the_ranks_node(monkeypatch):
    from distlab.notebook.world import plan_world
    from distlab.rank.torchrun import set_environment

    identities = {
        e: {"host": host, "pid": e, "addr": f"10.0.0.{e}", "cuda_devices": 0, "launcher_rank": None,
            "python": "3.11", "torch": "2.13.0"}
        for e, host in enumerate(["node0", "node0", "node1", "node1", "node1"])
    }
    world = plan_world(identities, 5, "gloo", host_order=["node0", "node1"])
    assert world.hosts() == ["node0", "node1"]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    set_environment(_spec(rank=3, world_size=5, node=1, nodes=2, ranks_on_node=3))
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                       "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41234",
    }


def test_the_script_holds_the_cells_in_order_and_says_what_it_lacks():
    history = [
        CellRan("import os\nx = 1\n"),
        Pushed(("lr", "data")),
        CellRan("print('only me')", ranks=(1,)),
        CellRan("y = x + 1\n%time z = y * 2\nif y:\n    !echo hi\ns = '''\n%not a magic\n'''\n"),
        ScriptRan(("train.py", "--epochs", "2")),
        Restarted(4),
        CellRan("def setup():\n    dist.init_process_group(\n        'gloo')\nsetup()\n"
                "g = dist.new_group([0, 1])\ndist.destroy_process_group(g)\ndist.destroy_process_group()\n"
                "dist.init_process_group(rank=rank)  # NCCL on GPUs, gloo otherwise\n"),
    ]
    script = build_script(history, world_size=4, backend="gloo", name="out/train.py")
    text = script.text
    compile(text, "train.py", "exec")  # plain Python: what torchrun runs
    assert script.cells == 3
    assert text.startswith("# out/train.py: the %%ddp cells a distlab lab of 4 ranks ran")
    assert "#     torchrun --standalone --nproc_per_node=4 out/train.py" in text
    assert 'dist.init_process_group("gloo")\n' in text and text.endswith("\ndist.destroy_process_group()\n")
    assert text.index("# %%ddp cell 1\nimport os") < text.index("# lab.push here: lr, data") < text.index(
        "# %%ddp -r 1 cell 2: ran on rank 1 only, so it is left out") < text.index("# %%ddp cell 3") < text.index(
        "# %dist run train.py --epochs 2 ran here") < text.index("# %dist restart here") < text.index("# %%ddp cell 4")
    assert "#     print('only me')" in text and "\nprint('only me')" not in text
    # IPython-only lines became pass at their indentation; a % line inside a string stayed
    assert "\npass  # IPython only, torchrun cannot run it: %time z = y * 2\n" in text
    assert "\n    pass  # IPython only, torchrun cannot run it: !echo hi\n" in text
    assert "\n%not a magic\n" in text
    # the group is made at the script's top and destroyed at its end; a subgroup's destroy stays
    assert "\n    pass  # the group is made at this script's top" in text and "\n    # 'gloo')\n" in text
    assert "\ndist.destroy_process_group(g)\n" in text
    assert "\npass  # the group is made at this script's top, destroyed at its end (in the lab, it stayed up): " \
           "dist.destroy_process_group()\n" in text
    # A comment after it is no code.
    assert "\npass  # the group is made at this script's top, destroyed at its end (in the lab, it stayed up): " \
           "dist.init_process_group(rank=rank)  # NCCL on GPUs, gloo otherwise\n" in text
    assert "import distlab" not in text  # no cell uses it
    assert [note.split(":")[0] for note in script.notes] == [
        "names the lab pushed to the ranks (lab.push) are not defined here",
        "cells that ran on some ranks only (%%ddp -r) are left out, their code kept as comments",
        "lines only IPython runs (magics, ! shell escapes) are commented out, pass in their place",
        "scripts run with %dist run are not copied in",
    ]
    assert "lr, data" in script.notes[0] and "cell 2 (rank 1)" in script.notes[1]
    assert "cell 3 line 2 (%time z = y * 2), cell 3 line 4 (!echo hi)" in script.notes[2]
    for note in script.notes:
        assert f"# Note: {note}." in text


def test_a_gpu_labs_script_binds_each_rank_to_its_gpu_and_imports_distlab_when_a_cell_uses_it():
    text = build_script([CellRan("distlab.log(loss=1.0)")], world_size=2, backend="nccl", name="t.py").text
    assert 'device = torch.device("cuda", local_rank)\ntorch.cuda.set_device(device)\n' \
           'dist.init_process_group("nccl", device_id=device)\n' in text
    assert "\nimport distlab  # " in text and "set_num_threads" not in text


def test_a_script_from_gloo_ranks_sharing_gpus_shares_them_too_and_one_from_cpu_ranks_stays_on_the_cpu():
    shared = build_script([CellRan("x = 1")], world_size=2, backend="gloo", name="t.py", on_gpus=True).text
    compile(shared, "t.py", "exec")
    assert 'device = torch.device("cuda", local_rank % torch.cuda.device_count())\n' \
           'torch.cuda.set_device(device)\ndist.init_process_group("gloo")\n' in shared
    cpu = build_script([CellRan("x = 1")], world_size=2, backend="gloo", name="t.py").text
    assert 'device = torch.device("cpu")\ndist.init_process_group("gloo")\n' in cpu and "cuda" not in cpu


# ------------------------------------------------------------------------------ one lab for the module


@pytest.fixture(scope="module")
def _torchrun_lab() -> Iterator[Lab]:
    lab = distlab.start(ranks=2, timeout=30)
    try:
        yield lab
    finally:
        lab.stop()


@pytest.fixture
def lab(_torchrun_lab: Lab) -> Lab:
    """The module's 2-rank lab; a fresh world if an earlier test left it another size or broken."""
    if _torchrun_lab.world_size != 2 or any(row.health != "ok" for row in _torchrun_lab.status()):
        _torchrun_lab.restart(ranks=2)
    return _torchrun_lab


@pytest.fixture
def shell(ipython: object, lab: Lab) -> Iterator[object]:
    """The IPython shell's magics driving the module's lab (given back, not stopped, afterwards)."""
    magics = distlab.front.magics._registered[id(ipython)]
    magics.lab = lab
    try:
        yield ipython
    finally:
        magics.lab = None  # the ipython fixture would stop it


def _everywhere(lab: Lab, code: str) -> object:
    """The one value every rank gave ``code``."""
    values = set(lab.run(code, stream=False).values())
    assert len(values) == 1, values
    return values.pop()


def _group_works(lab: Lab) -> bool:
    code = "t = torch.ones(1) * (rank + 1); dist.all_reduce(t); (dist.is_initialized(), t.item())"
    return dict(lab.run(code, stream=False)) == {0: (True, 3.0), 1: (True, 3.0)}


@cluster
def test_every_rank_has_torchruns_variables_for_the_labs_world(lab):
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT")
    seen = lab.run(f"import os\n{{k: os.environ[k] for k in {names!r}}}", stream=False)
    ports = {env["MASTER_PORT"] for env in seen.values()}
    for rank, env in seen.items():
        assert {k: env[k] for k in names[:-1]} == {
            "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        }
    assert len(ports) == 1 and ports != {"29500"}


@cluster
@pytest.mark.parametrize("call", [
    'dist.init_process_group("gloo", rank=rank, world_size=world_size)',
    "dist.init_process_group()",
    'dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method="env://", world_size=2, device_id=device)',
    'from torch.distributed import init_process_group\ninit_process_group("gloo", init_method="tcp://10.9.9.9:1")',
])
def test_init_process_group_in_a_cell_joins_the_labs_group(lab, capsys, call):
    lab.run(call)
    out = capsys.readouterr().out
    assert out in ("", JOINED + "\n")  # said once in each group (the test below)
    assert _group_works(lab)


JOINED = ("[rank 0] distlab: the lab's process group is already initialised (gloo, world size 2); "
          "init_process_group joined it")
LEFT = ("[rank 0] distlab: destroy_process_group() left the lab's process group up for the next cells; "
        "%dist stop ends it")


@cluster
def test_the_joined_and_left_notes_are_said_once_in_each_group(lab, capsys):
    lab.restart(ranks=2)  # a fresh group: nothing said in it yet
    capsys.readouterr()
    for _ in range(3):  # a tutorial's setup() and cleanup() in three cells
        lab.run('dist.init_process_group("gloo")\ndist.destroy_process_group()')
    assert capsys.readouterr().out.splitlines() == [JOINED, LEFT]
    lab.restart(ranks=2)
    capsys.readouterr()
    lab.run('dist.init_process_group("gloo")')
    lab.run('dist.init_process_group("gloo")')
    assert capsys.readouterr().out.splitlines() == [JOINED]


@cluster
def test_a_call_that_cannot_join_fails_in_one_clear_error_and_the_group_stays(lab):
    for call, first in [
        ('dist.init_process_group("gloo", world_size=4)',
         ("ranks 0-1: ValueError: init_process_group(world_size=4) but this lab has 2 ranks: "
          "start the lab with %dist start -n 4 (or %dist restart -n 4), or pass world_size=2")),
        ('dist.init_process_group("nccl")',
         "ranks 0-1: ValueError: init_process_group('nccl') but this lab's process group is gloo, on CPU ranks"),
        # Each rank raises its own: the report leads with whichever raised first, so either may lead.
        ("dist.init_process_group(rank=1 - rank)",
         ("rank 0: ValueError: init_process_group(rank=1) but this is rank 0 of the lab",
          "rank 1: ValueError: init_process_group(rank=0) but this is rank 1 of the lab")),
    ]:
        with pytest.raises(RankError) as info:
            lab.run(call, stream=False)
        assert str(info.value).splitlines()[0].startswith(first), str(info.value)
        if isinstance(first, tuple):  # both ranks' errors are in the report
            assert all(any(line.startswith(one) for line in str(info.value).splitlines()) for one in first)
        assert "distlab/rank" not in info.value.render()  # the traceback ends at the user's call
        assert not any("rebuilt" in note for note in info.value.notes)
    assert _group_works(lab)


@cluster
def test_destroy_process_group_leaves_the_labs_group_but_really_destroys_a_subgroup(lab, capsys):
    lab.run("sub = dist.new_group([0, 1])\ndist.destroy_process_group(sub)\ndist.destroy_process_group()")
    assert capsys.readouterr().out in ("", LEFT + "\n")  # said once in each group
    with pytest.raises(RankError, match="KeyError"):
        lab.run("dist.get_process_group_ranks(sub)", stream=False)  # torch no longer knows the subgroup
    assert _group_works(lab)
    # distlab's own teardown and rebuild of the group still really replace it
    with pytest.raises(RankError) as info:
        lab.run("if rank == 1:\n    raise ValueError('bad shard')\nt = torch.ones(1)\ndist.all_reduce(t)", stream=False)
    assert any("rebuilt" in note for note in info.value.notes)
    assert _group_works(lab)


@cluster
def test_dist_run_runs_a_torchrun_script_on_every_rank_with_its_arguments(shell, lab, tmp_path, capsys):
    script = tmp_path / "ddp_setup.py"
    script.write_text(SETUP_SCRIPT)
    shell.run_line_magic("dist", f"run {script} --epochs 2 -v")
    lines = capsys.readouterr().out.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2: sum 3, argv ['--epochs', '2', '-v'], local rank {rank}" in lines
    said = [line for line in lines if "distlab:" in line]
    assert set(said) <= {JOINED, LEFT} and len(said) == len(set(said))  # each at most once in a group
    assert _group_works(lab)
    # the names the script defined are the ranks' now, as IPython's %run leaves them
    assert _everywhere(lab, "(callable(setup), callable(main))") == (True, True)
    assert _everywhere(lab, "import sys\n'--epochs' in sys.argv") is False  # the engine's own argv is back


@cluster
def test_a_failing_script_comes_back_as_a_rank_error_at_the_scripts_lines(lab, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import torch\n\n\ndef load(shard):\n    raise FileNotFoundError(f'no shard {shard}')\n\n\n"
                      "load(int(__import__('os').environ['RANK']) * 0)\n")
    with pytest.raises(RankError) as info:
        lab.run_script(script, stream=False)
    assert str(info.value).splitlines()[0] == "ranks 0-1: FileNotFoundError: no shard 0"
    text = info.value.render()
    assert f'File "{script}", line 8, in <module>' in text and f'File "{script}", line 5, in load' in text
    assert "raise FileNotFoundError(f'no shard {shard}')" in text
    assert "distlab" not in text.replace(str(tmp_path), "")
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nrank, device = 99, 'cuda:7'\nprint('done')\nsys.exit(0)\n")
    assert dict(lab.run_script(exits, stream=False)) == {0: None, 1: None}
    assert dict(lab.run("(rank, str(device))", stream=False)) == {0: (0, "cpu"), 1: (1, "cpu")}  # still the lab's
    exits.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(RankError, match="SystemExit: 3"):
        lab.run_script(exits, stream=False)
    assert _group_works(lab)


@cluster
@pytest.mark.parametrize("call, fragment", [
    (lambda lab, tmp: lab.run_script(tmp / "nowhere.py"), "no such file: "),
    (lambda lab, tmp: lab.run_script(tmp), "is a folder, not a script"),
    (lambda lab, tmp: lab.run_script(tmp / "bad.py"), "bad.py line 2: "),
    (lambda lab, tmp: lab.run_script(tmp / "ok.py", args="--epochs 2"), "args are the script's arguments as a list"),
    (lambda lab, tmp: lab.run_script(tmp / "ok.py", args=["--epochs", 2]), "must be text, as on a command line"),
    (lambda lab, tmp: lab.run_script(42), "the script's path must be a file name"),
    (lambda lab, tmp: lab.export(tmp / "no" / "such" / "t.py"), "/no/such does not exist; create it"),
    (lambda lab, tmp: lab.export(tmp), "is a folder: give a file name in it"),
    (lambda lab, tmp: lab.export(""), "the script's path must be a file name, like lab.export('train.py')"),
])
def test_bad_paths_and_arguments_get_one_line_and_run_nothing(lab, tmp_path, call, fragment):
    (tmp_path / "bad.py").write_text("x = 1\ndef (:\n")
    (tmp_path / "ok.py").write_text("ran = True\n")
    lab.run("ran = False", stream=False, record=False)
    with pytest.raises(LabUsageError) as info:
        call(lab, tmp_path)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert _everywhere(lab, "ran") is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.py", "ok.py"]  # nothing written


def _torchrun(script: Path, timeout_s: float = 240) -> tuple[int, str]:
    """Run ``script`` with real torchrun, 2 processes on this machine, within a deadline; nothing outlives it."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.Popen(
        [torchrun, "--standalone", "--nproc_per_node=2", str(script)], cwd=script.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its workers too are ended below, whatever happens
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out = ""
        pytest.fail(f"torchrun ran past {timeout_s:g} s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, out


def _same_weights(a: Path, b: Path) -> bool:
    import torch

    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return list(first) == list(second) and all(torch.equal(first[k], second[k]) for k in first)


@cluster
def test_an_export_runs_under_torchrun_and_trains_to_the_labs_weights_bit_for_bit(shell, lab, tmp_path, capsys):
    lab.cells.clear_history()  # this test's cells only: the lab is the module's
    weights = tmp_path / "weights.pt"
    cells = [
        ("", ("import os\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n\ndef setup():\n"
             '    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), '
             'world_size=int(os.environ["WORLD_SIZE"]))'
             f"\n\n\nsetup()\nout_path = {str(weights)!r}\n")),
        ("", ("torch.manual_seed(0)\n"
              "model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n%env DISTLAB_EXPORT_TEST=1\n")),
        ("-r 1", "print('rank 1 alone')"),
        ("", ("gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data\n"
              "with distlab.watch(model):\n"
             "    for step in range(6):\n"
             "        x = torch.randn(32, 8, generator=gen)\n"
             "        opt.zero_grad()\n"
             "        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()\n"
             "        loss.backward()\n"
             "        opt.step()\n"
             "        distlab.log(loss=loss)\n")),
        ("", ("if rank == 0:\n    torch.save(model.module.state_dict(), out_path)\ndist.barrier()\n"
              "dist.destroy_process_group()\n")),
    ]
    for line, cell in cells:
        shell.run_cell_magic("ddp", line, cell)
    lab.push(unused_here=3)
    (tmp_path / "lab.pt").write_bytes(weights.read_bytes())
    weights.unlink()
    script = tmp_path / "train.py"
    capsys.readouterr()
    shell.run_line_magic("dist", f"export {script}")
    said = capsys.readouterr().out.splitlines()
    assert said[0] == f"wrote {script}; torchrun runs it as it is: torchrun --standalone --nproc_per_node=2 {script}"
    assert said[1].startswith(f"note: {script}: names the lab pushed to the ranks (lab.push) are not defined here: "
                              "unused_here")
    assert "cell 3 (rank 1)" in said[1] and "cell 2 line 4 (%env DISTLAB_EXPORT_TEST=1)" in said[1]
    text = script.read_text()
    assert [line for line in text.splitlines() if line.startswith("# %%ddp")] == [
        "# %%ddp cell 1", "# %%ddp cell 2", ("# %%ddp -r 1 cell 3: ran on rank 1 only, so it is left out (every rank "
        "runs this script;"), "# %%ddp cell 4", "# %%ddp cell 5",
    ]
    code, out = _torchrun(script)
    assert code == 0, out
    assert _same_weights(tmp_path / "lab.pt", weights)
    # and the exported script runs in the lab too, as any torchrun script does
    weights.rename(tmp_path / "torchrun.pt")
    lab.run_script(script, stream=False)
    assert _same_weights(tmp_path / "lab.pt", weights)
    assert _group_works(lab)


@cluster
def test_an_export_warns_what_it_lacks_and_refuses_when_nothing_ran_on_every_rank(lab, tmp_path):
    lab.cells.clear_history()
    lab.run("print('rank 0 alone')", ranks=0, stream=False)
    with pytest.raises(LabUsageError, match="no cell has run on every rank yet: there is nothing to export"):
        lab.export(tmp_path / "t.py")
    lab.run("answer = 42", stream=False)
    with pytest.warns(UserWarning, match="cells that ran on some ranks only"):
        assert lab.export(tmp_path / "t.py") == str(tmp_path / "t.py")
    assert "\n# %%ddp cell 2\nanswer = 42\n" in (tmp_path / "t.py").read_text()


@cluster
def test_torchruns_variables_follow_a_restart_at_another_size(lab, tmp_path):
    lab.restart(ranks=3)
    seen = lab.run("import os\n(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_WORLD_SIZE'], "
                   "os.environ['MASTER_PORT'])", stream=False)
    assert [v[:3] for v in seen.values()] == [("0", "3", "3"), ("1", "3", "3"), ("2", "3", "3")]
    script = tmp_path / "ddp_setup.py"
    script.write_text(SETUP_SCRIPT)
    result = lab.run_script(script, stream=False)
    for r in range(3):
        assert f"rank {r} of 3: sum 6, argv [], local rank {r}" in result.stdout[r].splitlines()


# ------------------------------------------------------------------------------ real code from elsewhere


@cluster
def test_a_second_dist_run_gets_its_own_folders_helper_and_an_edited_one_afresh(lab, tmp_path):
    # Two examples side by side, each with its own utils.py: torchrun gives each a fresh process.
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "utils.py").write_text(f"WHO = {name!r}\n")
        (tmp_path / name / "main.py").write_text("import utils\nprint(f'utils of {utils.WHO}')\n")
    seen = [lab.run_script(tmp_path / name / "main.py", stream=False).stdout for name in ("first", "second")]
    assert seen == [{0: "utils of first\n", 1: "utils of first\n"}, {0: "utils of second\n", 1: "utils of second\n"}]
    (tmp_path / "first" / "utils.py").write_text("WHO = 'first, edited'\n")
    assert lab.run_script(tmp_path / "first" / "main.py", stream=False).stdout[1] == "utils of first, edited\n"


LAUNCHER = textwrap.dedent("""\
    import torch.multiprocessing as mp
    size = 2
    processes = []
    for rank in range(size):
        p = mp.get_context("{method}").Process(target=init_process, args=(rank, size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
""")

TUTORIAL_FUNCTIONS = textwrap.dedent("""\
    import os

    def run(rank, size):
        pass

    def init_process(rank, size, fn, backend="gloo"):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = "29500"
        dist.init_process_group(backend, rank=rank, world_size=size)
        fn(rank, size)
""")


@cluster
def test_a_pasted_launcher_loop_gives_the_lab_its_rank_back_and_says_so_once_a_cell(lab, capsys):
    lab.run("for rank in range(3):\n    pass\ndel world_size")
    out = capsys.readouterr().out.splitlines()
    for r in (0, 1):
        assert f"[rank {r}] distlab: this cell rebound rank (to 2), world_size (deleted), a name distlab gives every " \
               f"cell; it is this rank's again (rank = {r}, world_size = 2): give your own variables other names " \
               "(for r in range(size): ...)" in out
    assert len(out) == 2
    assert dict(lab.run("(rank, world_size)", stream=False)) == {0: (0, 2), 1: (1, 2)}
    lab.run("rank = dist.get_rank()\ndevice = 'cpu'")  # the same values again: nothing to say
    assert capsys.readouterr().out == ""
    # in the cell that rebound it, init_process_group names the loop as the cause
    with pytest.raises(RankError) as info:
        lab.run("for rank in range(2):\n    pass\ndist.init_process_group('gloo', rank=rank, world_size=2)",
                stream=False)
    assert info.value.ranks == [0]  # rank 1's loop ended on 1: by chance its own
    assert info.value.summary.splitlines()[0] == (
        "rank 0: ValueError: init_process_group(rank=1) but this is rank 0 of the lab (this cell rebound distlab's "
        "rank to 1, as a launcher's loop `for rank in range(size)` does; in a lab every rank is already one process "
        "of the world: drop the loop, or name its variable otherwise): pass rank=int(os.environ['RANK']) (distlab "
        "sets it as torchrun does), or leave rank out"
    )
    assert dict(lab.run("rank", stream=False)) == {0: 0, 1: 1}
    assert _group_works(lab)


@cluster
def test_what_torchrun_refuses_or_hangs_on_joins_the_lab_with_a_warning_once(lab, capsys):
    lab.restart(ranks=2)  # a fresh group: nothing said in it yet
    capsys.readouterr()
    cell = ("import os\nport = os.environ['MASTER_PORT']\nos.environ['MASTER_PORT'] = '12355'\ntry:\n"
            "    dist.init_process_group('gloo', device_id=torch.device('cpu'))\nfinally:\n"
            "    os.environ['MASTER_PORT'] = port\n")
    lab.run(cell)
    lab.run(cell)
    said = capsys.readouterr()
    warnings = said.err.splitlines()
    assert len(warnings) == 2 and all(w.startswith("[rank 0] distlab: warning: ") for w in warnings), said.err
    assert "init_process_group(device_id=device(type='cpu')) joined the lab's group, but under torchrun torch " \
           "raises ValueError" in warnings[0]
    assert "MASTER_PORT is 12355 here, set by this code" in warnings[1]
    assert said.out.splitlines() == [JOINED]
    assert _group_works(lab)


@cluster
def test_torchrun_really_refuses_device_id_on_the_cpu_and_waits_on_a_port_the_script_fixed(tmp_path):
    # What the lab's warnings say torchrun does, checked on the torch installed here.
    script = tmp_path / "torchrun_claims.py"
    script.write_text(textwrap.dedent("""\
        import datetime
        import os

        import torch
        import torch.distributed as dist

        try:
            dist.init_process_group("gloo", device_id=torch.device("cpu"))
        except ValueError as exc:
            print(f"refused: {exc}", flush=True)
        os.environ["MASTER_PORT"] = "1"  # nobody serves it
        try:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
        except Exception as exc:  # noqa: BLE001 - torch's store error, whichever it is
            print(f"waited: {type(exc).__name__}", flush=True)
    """))
    code, out = _torchrun(script)
    assert code == 0, out
    assert out.count("refused: init_process_group device_id parameter must be an accelerator with an index") == 2, out
    assert out.count("waited: ") == 2, out


@cluster
def test_a_cell_whose_child_processes_failed_fails_naming_each_child_and_where_it_started(lab, capsys):
    with pytest.raises(RankError) as info:
        lab.run(TUTORIAL_FUNCTIONS + LAUNCHER.format(method="spawn"), stream=False)  # the tutorial's block, as pasted
    assert info.value.ranks == [0, 1]
    for rank, failure in info.value.failures.items():
        assert failure.ename == "ChildProcessFailed"
        assert re.fullmatch(
            r"2 child processes this cell started failed: pid \d+ \(target init_process\) exited with code 1; "
            r"pid \d+ \(target init_process\) exited with code 1 \(their own errors are on the rank's stderr\)\. "
            r"On a lab every rank is already one of the world's processes: call the target on each rank instead of "
            r"starting processes, e.g\. run\(rank, world_size\)", failure.evalue), failure.evalue
        assert f'File "<rank {rank} cell>", line 16, in <module>\n    p.start()' in failure.traceback
    assert dict(lab.run("rank", stream=False)) == {0: 0, 1: 1}  # the loop's rank was given back
    # children that succeed, or that the cell itself stops, say nothing
    result = lab.run("import multiprocessing as mp, time\nok = mp.get_context('fork').Process(target=int)\n"
                     "slow = mp.get_context('fork').Process(target=time.sleep, args=(60,))\nok.start(); slow.start()\n"
                     "slow.kill(); ok.join(); slow.join()\n(ok.exitcode, slow.exitcode)", stream=False)
    assert dict(result) == {0: (0, -9), 1: (0, -9)}
    with pytest.raises(RankError) as info:
        lab.run("import os, signal\n"
                "child = mp.get_context('fork').Process(target=lambda: os.kill(os.getpid(), signal.SIGKILL))\n"
                "child.start(); child.join()", ranks=1, stream=False)
    assert re.search(r"a child process this cell started failed: pid \d+ \(target <lambda>\) was killed by SIGKILL",
                     info.value.failures[1].evalue)
    assert _group_works(lab)
