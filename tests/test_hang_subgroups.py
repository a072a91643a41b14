"""A hang inside a sub-group (a dimension of a 2x2 device mesh) is diagnosed by its group: which
collective, which members waited, which never arrived; the default group's note stays as it was.
A pipeline's send that its next stage never receives is named with both ranks."""

from __future__ import annotations

import re

import pytest

from distlab.errors import CellTimeout

pytestmark = pytest.mark.cluster

MESH = (
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n"
)


def _hang_note(lab, code: str, setup: str = "") -> str:
    lab.run(MESH + setup, stream=False)  # imports and models before the cell with a deadline
    with pytest.raises(CellTimeout) as info:
        lab.run(code, timeout=6, stream=False)
    return "\n".join(info.value.notes)


def test_a_tensor_parallel_group_that_one_rank_skips_is_named_with_who_waited(lab_factory):
    lab = lab_factory(ranks=4)
    note = _hang_note(lab, "t = torch.ones(4)\nif rank != 1:\n    dist.all_reduce(t, group=mesh['tp'].get_group())\n")
    # tp groups are ranks 0-1 and 2-3: 2-3 finished theirs; rank 0 waits for rank 1.
    assert ("collective #1 in group mesh_tp of ranks 0-1 (all_reduce of [4] float32): rank 0 waited in it; "
            "rank 1 never arrived (it had made no collective; its cell had finished)") in note, note
    assert "ranks 2-3" not in note and "of ranks 2,3" not in note
    # The lab is usable again.
    assert lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False) == dict.fromkeys(range(4), 4.0)


def test_an_fsdp2_forward_that_one_rank_skips_names_the_data_parallel_group(lab_factory):
    lab = lab_factory(ranks=4)
    setup = (
        "from torch.distributed.fsdp import fully_shard\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
        "_ = fully_shard(model, mesh=mesh['dp'])\n"
    )
    note = _hang_note(lab, "if rank != 3:\n    model(torch.ones(2, 8)).sum().backward()\n", setup)
    # dp groups are ranks 0,2 and 1,3: FSDP2's all-gather of the parameters waits for rank 3.
    line = next((n for n in note.splitlines() if "in group mesh_dp of ranks 1,3" in n), None)
    assert line is not None, note
    assert "rank 1 waited in it" in line and "rank 3 never arrived" in line, line
    assert "all_gather" in line, line
    assert note.count("\ncollective #") == 0 and "in group mesh_tp" not in note, note  # that one group only


def test_a_pipeline_send_that_the_next_stage_never_receives_names_both_ranks(lab_factory):
    lab = lab_factory(ranks=4)
    pipeline = (
        "from torch.distributed.pipelining import PipelineStage, ScheduleGPipe\n"
        "pp = mesh['pp']\n"
        "torch.manual_seed(0)\n"
        "stage = PipelineStage(\n"
        "    torch.nn.Linear(8, 8), pp.get_local_rank(), 2, torch.device('cpu'), group=pp.get_group())\n"
        "schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: out.sum())\n"
        "def train_step(skip=None):\n"
        "    if rank == skip:\n"
        "        return\n"
        "    x = torch.ones(4, 8)\n"
        "    schedule.step(x) if pp.get_local_rank() == 0 else schedule.step(target=x)\n"
        "train_step()\n"  # one whole step first: the stages' set-up messages are behind us
    )
    with pytest.raises(CellTimeout) as info:
        lab.run(MESH.replace("'tp'", "'pp'") + pipeline, stream=False)
        lab.run("train_step(skip=3)", timeout=6, stream=False)
    note = "\n".join(info.value.notes)
    # pp groups are ranks 0-1 and 2-3: stage 0 of the second pipeline (rank 2) sends its first
    # micro-batch's activations ([2, 8]) to rank 3, which skipped the step (GPipe posts the second's too).
    found = re.search(
        r"send #(\d+) to rank 3 in group mesh_pp of ranks 2-3 \(send of \[2, 8\] float32\): "
        r"rank 2 waited in it and 1 after it; "
        r"rank 3 never posted the matching recv \(it had posted (\d+) recvs? from rank 2; its cell had finished\)",
        note,
    )
    assert found is not None, note
    assert int(found[2]) == int(found[1]) - 1, note
    assert "rank 0" not in note and "rank 1 " not in note, note  # the first pipeline finished its step
    assert lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False) == dict.fromkeys(range(4), 4.0)
