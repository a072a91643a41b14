"""distlab.watch on what the new parallelisms do: point-to-point rings (context parallelism), and
collectives after the update (local SGD), each in the record of its step."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cluster


def test_a_ring_of_sends_and_receives_in_a_forward_is_recorded_op_by_op(lab):
    # Ring attention's pattern: each rank passes a block to the next and receives the previous one's,
    # world_size - 1 times per forward, with batch_isend_irecv.
    result = lab.run(
        "import torch\n"
        "import torch.distributed as dist\n"
        "class Ring(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = torch.nn.Linear(32, 32)\n"
        "    def forward(self, x):\n"
        "        kv, out = self.proj(x), 0\n"
        "        for _ in range(world_size - 1):\n"
        "            incoming = torch.empty_like(kv)\n"
        "            for work in dist.batch_isend_irecv([\n"
        "                    dist.P2POp(dist.isend, kv.detach(), (rank + 1) % world_size),\n"
        "                    dist.P2POp(dist.irecv, incoming, (rank - 1) % world_size)]):\n"
        "                work.wait()\n"
        "            out = out + (self.proj(x) * incoming).sum()\n"
        "            kv = incoming\n"
        "        return out + kv.sum()\n"
        "torch.manual_seed(0)\n"
        "model = Ring()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "with distlab.watch(model, stats_every=0, checksum_every=0, publish=False, replicated=False) as w:\n"
        "    for _ in range(2):\n"
        "        opt.zero_grad()\n"
        "        model(torch.randn(16, 32)).backward()\n"
        "        opt.step()\n"
        "[sorted((c['op'], c['bytes'], c.get('untimed', False), c['seconds']) for c in r['collectives'])\n"
        " for r in w.records()]",
        stream=False,
    )
    block = 16 * 32 * 4
    for rank in (0, 1):
        # gloo gives a send or receive no future, and it may be waited for once only, by its caller:
        # listed with its bytes, untimed. (Waited for where it was posted, the ring hung.)
        assert result[rank] == [[("recv", block, True, 0.0), ("send", block, True, 0.0)]] * 2


def test_collectives_after_an_update_belong_to_the_step_they_follow(lab):
    # Local SGD: each rank steps alone and the models are averaged after every second update.
    result = lab.run(
        "import torch\n"
        "import torch.distributed as dist\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(64, 64)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "with distlab.watch(model, stats_every=0, checksum_every=0, publish=False) as w:\n"
        "    for step in range(4):\n"
        "        opt.zero_grad()\n"
        "        model(torch.randn(8, 64)).square().mean().backward()\n"
        "        opt.step()\n"
        "        if step % 2 == 1:\n"
        "            for p in model.parameters():\n"
        "                dist.all_reduce(p.data)\n"
        "                p.data /= world_size\n"
        "[( [(c['op'], c['bytes']) for c in r['collectives']],\n"
        "   all(c['start_s'] >= r['step_time_s'] for c in r['collectives']), r['comm_s']) for r in w.records()]",
        stream=False,
    )
    averaged = [("all_reduce", 64 * 64 * 4), ("all_reduce", 64 * 4)]
    for rank in (0, 1):
        steps = result[rank]
        assert [ops for ops, _, _ in steps] == [[], averaged, [], averaged]
        # They came after the update, and the step's exposed communication does not count them.
        assert all(after for _, after, _ in steps)
        assert [comm for _, _, comm in steps] == [0.0] * 4


