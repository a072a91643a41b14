"""Breakpoints on collectives: every rank stops before the chosen collective, on real ranks; the notebook
reads the paused frames, steps collective by collective and continues, and the step ends as it would
have unpaused."""

from __future__ import annotations

import re

import pytest

from distlab.errors import LabUsageError

pytestmark = pytest.mark.cluster

THREE = """
t = torch.ones(4, device=device) * (rank + 1)
dist.all_reduce(t)
u = t * 2
dist.all_reduce(u)
dist.barrier()
u.sum().item()
"""


def test_every_rank_stops_before_the_nth_collective_steps_to_the_next_and_continues(lab, capsys):
    lab.pause(at=2)
    result = lab.run(THREE)
    pause = result.paused
    assert pause is not None and lab.paused is pause and dict(result) == {}
    assert (pause.index, pause.op, pause.group, pause.disagree) == (2, "all_reduce", "default_pg", [])
    assert [(r.rank, r.line, r.source, r.shapes, r.dtypes) for r in pause.rows] == [
        (rank, 5, "dist.all_reduce(u)", ((4,),), ("float32",)) for rank in (0, 1)]  # the lines of THREE as given
    # What each rank would send: u = 2 x (1 + 2) everywhere, so equal norms and hashes.
    assert {r.norms[0] for r in pause.rows} == {12.0} and len({r.hashes[0] for r in pause.rows}) == 1
    # The paused frames are read while the ranks wait; what needs their main threads is refused.
    assert {rank: v.tolist() for rank, v in lab.pull("u").items()} == {0: [6.0] * 4, 1: [6.0] * 4}
    for refused in (lambda: lab.run("1"), lambda: lab.push(x=1), lambda: lab.pause(at=1)):
        with pytest.raises(LabUsageError, match=r"paused before collective 2 .all_reduce.*lab.step"):
            refused()
    following = lab.step()
    assert following is not None and (following.index, following.op, following.rows[0].line) == (3, "barrier", 6)
    assert {rank: v.tolist() for rank, v in lab.pull("u").items()} == {0: [12.0] * 4, 1: [12.0] * 4}
    assert dict(lab.cont()) == {0: 48.0, 1: 48.0} and lab.paused is None
    # One cell was armed: the next runs through.
    assert dict(lab.run(THREE, stream=False)) == {0: 48.0, 1: 48.0}


def test_stepping_to_the_cells_end_returns_none_and_shows_its_output(lab, capsys):
    lab.pause(op="barrier")
    assert lab.run("dist.barrier()\nprint('after', rank)").paused.op == "barrier"
    capsys.readouterr()
    assert lab.step() is None and lab.paused is None
    assert "after 0" in capsys.readouterr().out


def test_a_breakpoint_on_a_group_passes_the_collectives_of_other_groups(lab):
    lab.run("pair = dist.new_group([0, 1], group_desc='pair')", stream=False)
    lab.pause(group="pair")
    cell = "t = torch.ones(2, device=device)\ndist.all_reduce(t)\ndist.all_reduce(t, group=pair)\nt.sum().item()"
    pause = lab.run(cell, stream=False).paused
    assert pause is not None and (pause.index, pause.group, pause.rows[0].line) == (2, "pair", 3)
    assert pause.rows[0].norms == (2.0 * 2**0.5,)  # after the first all-reduce: [2, 2]
    assert dict(lab.cont()) == {0: 8.0, 1: 8.0}


def test_bad_breakpoints_and_words_without_a_pause_get_one_line_and_arm_nothing(lab, capsys):
    for bad, says in [({"at": 0}, "from 1"), ({"op": "allreduce"}, "one of all_reduce, all_gather"),
                      ({"line": 0}, "a line of the cell"), ({"group": ""}, "default_pg"),
                      ({"timeout": -1}, "timeout")]:
        with pytest.raises(LabUsageError, match=re.escape(says)) as info:
            lab.pause(**bad)
        assert "\n" not in str(info.value)
    for word in (lab.step, lab.cont):
        with pytest.raises(LabUsageError, match=r"nothing is paused.*lab.pause"):
            word()
    assert dict(lab.run(THREE, stream=False)) == {0: 48.0, 1: 48.0}  # nothing was armed
    # Past the cell's last collective: the cell ends as usual, and says what it ran.
    lab.pause(at=9, group="mesh_tp")
    capsys.readouterr()
    assert dict(lab.run(THREE)) == {0: 48.0, 1: 48.0}
    out = capsys.readouterr().out
    assert "the breakpoint at the 9th collective on mesh_tp was not reached: this cell ran 3 collectives " \
           "(groups: default_pg)" in out


def test_a_collective_one_rank_skips_shows_that_rank_as_having_ended_the_cell(lab_factory):
    lab = lab_factory(ranks=2, timeout=20)
    lab.pause(at=1)
    pause = lab.run("t = torch.ones(2, device=device)\nif rank == 0:\n    dist.all_reduce(t)\n", timeout=10).paused
    assert pause is not None and [r.rank for r in pause.rows] == [0] and pause.ended == (1,)
    assert "rank 1 ended the cell" in pause.text() and pause.rows[0].line == 3


def test_ranks_running_different_collectives_are_marked(lab_factory):
    lab = lab_factory(ranks=2, timeout=20)
    lab.pause(at=1)
    cell = ("t = torch.ones(2 + rank, device=device)\n"
            "if rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, 0)\n")
    pause = lab.run(cell, timeout=10).paused
    assert pause is not None and [r.op for r in pause.rows] == ["all_reduce", "broadcast"]
    assert pause.disagree == [1] and "<- differs" in pause.text() and "background:#fdd" in pause._repr_html_()


STEP_SETUP = {
    "ddp": """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                          torch.nn.Linear(512, 8)).to(device)
# DDP's first bucket holds 1 MiB, the others bucket_cap_mb: the 1 MiB layer and the rest, apart
model = DDP(net, bucket_cap_mb=0.01)
""",
    "fsdp2": """
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
for part in (model[0], model[2], model):
    fully_shard(part)
""",
    "tp": """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
torch.manual_seed(0)
mesh = init_device_mesh(device.type, (1, 2), mesh_dim_names=("dp", "tp"))
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
""",
}
STEP = """
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(1 + rank)
for _ in range(2):   # DDP's first backward fills its buckets in parameter order, the second as measured
    opt.zero_grad()
    model(torch.randn(16, 8, device=device)).square().mean().backward()
    opt.step()
total = sum(float(p.detach().full_tensor().double().sum() if hasattr(p, "full_tensor") else p.detach().double().sum())
            for p in model.parameters())
total
"""
# (the first collective, the group it runs on, and the op the breakpoint names) for each kind of step
FIRST = {"ddp": ("all_reduce", "default_pg"), "fsdp2": ("all_gather", "default_pg"), "tp": ("all_reduce", "default_pg")}
# (at 2 ranks a 1 x 2 mesh's "tp" dimension spans the world, and DeviceMesh reuses the default group)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "tp"])
def test_a_step_paused_and_stepped_collective_by_collective_ends_with_the_weights_of_an_unpaused_one(lab, kind):
    lab.run(STEP_SETUP[kind], stream=False)
    unpaused = dict(lab.run(STEP, stream=False))
    lab.run(STEP_SETUP[kind], stream=False)
    op, group = FIRST[kind]
    lab.pause(op=op, group=group)
    pause = lab.run(STEP, stream=False).paused
    assert pause is not None and (pause.op, pause.group, pause.disagree) == (op, group, [])
    seen, index = [pause.op], pause.index
    while (pause := lab.step()) is not None:
        assert pause.index == index + 1 and pause.disagree == []
        seen.append(pause.op)
        index = pause.index
    assert len(seen) >= 2, seen
    assert lab.paused is None and lab.pull("total") == unpaused  # the same weights as the unpaused step
