"""distlab.divergence on real ranks: the first op where replicas part, its module and what differs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cluster

SETUP = """torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))   # each rank its own batch
"""


def test_replicas_that_agree_are_said_to_agree_whatever_batch_each_rank_holds(lab):
    # The batch is rank 0's everywhere: the ranks' own batches differ, yet every op agrees.
    said = lab.run(SETUP + "str(distlab.divergence(net, x, backward=True))", stream=False)
    assert said[0] == said[1]
    assert said[0].startswith("the replicas agree on every op of the step (")


def test_batchnorm_buffers_that_drifted_are_found_at_the_batch_norm_op(lab):
    code = SETUP + (
        "with torch.no_grad():\n"
        "    net[1].running_mean += rank       # what DDP leaves apart without broadcast_buffers\n"
        "net.eval()\n"
        "report = distlab.divergence(net, x)\n"
        "(report.index, report.op, report.module, report.groups, report.state, str(report))"
    )
    said = lab.run(code, stream=False)
    assert said[0] == said[1]
    index, op, module, groups, state, text = said[0]
    assert (op, module, groups, state) == ("native_batch_norm", "1 (BatchNorm1d)", [[0], [1]], ["running_mean"])
    assert index == 3  # the Linear before it (three ops) agreed
    assert text.splitlines() == [
        "the replicas part at op #3 of the step, native_batch_norm in module 1 (BatchNorm1d), cell line 7: "
        "report = distlab.divergence(net, x): rank 0 vs rank 1 (every op before it agreed)",
        "its module's state differs between ranks: running_mean",
    ]


def test_a_weight_one_rank_changed_parts_the_replicas_at_its_first_use(lab):
    code = SETUP + (
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = net\n"
        "    def forward(self, x):\n"
        "        h = self.body[0](x)\n"
        "        return self.body[2](self.body[1](h).relu())\n"
        "model = Net()\n"
        "with torch.no_grad():\n"
        "    net[2].weight[0, 0] += 0.5 * rank\n"
        "report = distlab.divergence(model, x, backward=True)\n"
        "(report.module, report.line, report.source, report.state)"
    )
    said = lab.run(code, stream=False)
    # The op is in the cell's own forward, at its line; the module is the one whose weight moved.
    assert said[0] == said[1] == ("body.2 (Linear)", 10, "return self.body[2](self.body[1](h).relu())", ["weight"])


def test_a_ddp_model_whose_head_only_rank_0_loaded_parts_at_the_head(lab):
    # DDP's forward records profiler ranges (ops whose outputs are handles, not values): they agree.
    code = SETUP + (
        "model = torch.nn.parallel.DistributedDataParallel(net)   # broadcasts rank 0's weights\n"
        "torch.manual_seed(1)\n"
        "head = torch.nn.Linear(4, 2).state_dict()\n"
        "if rank == 0:\n"
        "    net[2].load_state_dict(head)   # after DDP's broadcast, on one rank: the replicas part\n"
        "report = distlab.divergence(model, x)\n"
        "(report.op, report.module, report.state)"
    )
    said = lab.run(code, stream=False)
    # The Linear's first op is the transpose of its weight (aten.t), before its addmm.
    assert said[0] == said[1] == ("t", "2 (Linear)", ["weight", "bias"]), said


def test_outside_a_process_group_it_says_where_to_call_it(lab):
    said = lab.run(
        "import subprocess, sys\n"
        "code = 'import torch, distlab; distlab.divergence(torch.nn.Linear(2, 2), torch.ones(1, 2))'\n"
        "subprocess.run([sys.executable, '-c', code], capture_output=True, text=True).stderr.strip().splitlines()[-1]",
        ranks=0, stream=False,
    )
    assert said[0] == "RuntimeError: distlab.divergence compares ranks: call it in a %%ddp cell, on every rank"
