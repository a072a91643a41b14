"""distlab.watch on compiled models: real torch.compile on the ranks.

torch.compile runs with its ``aot_eager`` backend behind a backend that counts the graphs it is
given: the same graphs, cut the same way as with inductor, without inductor's tens of seconds of
code generation per rank.
"""

from __future__ import annotations

import collections

import pytest

from distlab import theory

pytestmark = pytest.mark.cluster

MiB = 2**20

# Defined on every rank: a model of LAYERS linear layers in a class of its own (torch.compile
# compiles the frames of user code: an nn.Sequential at the top is torch's code, and under DDP it
# stayed uncompiled), a backend that counts graphs, and a loop.
SETUP = """
import collections
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch.nn.parallel import DistributedDataParallel as DDP

LAYERS, WIDTH = 8, 512
graphs = []

def counting(gm, example_inputs):
    graphs.append(len(gm.graph.nodes))
    return lookup_backend("aot_eager")(gm, example_inputs)

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x

def make():
    torch.manual_seed(0)
    return Stack()

def train(run, model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        run(torch.randn(64, WIDTH, generator=g)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]

def compiled_ddp(cap_mb, split=True, watched=None):
    torch._dynamo.reset()
    graphs.clear()
    torch._dynamo.config.optimize_ddp = split
    model = DDP(make(), bucket_cap_mb=cap_mb)
    run = torch.compile(model, backend=counting)
    target = {"inner": model, "compiled": run}.get(watched)
    w = distlab.watch(target, stats_every=0, checksum_every=0, publish=False) if target is not None else None
    weights = train(run, model)
    if w is not None:
        w.close()
    torch._dynamo.config.optimize_ddp = True
    return len(graphs), weights, (w.records(), w.notes) if w is not None else None
"""

LAYER_BYTES = (512 * 512 + 512) * 4


def test_a_compiled_ddp_model_is_cut_at_its_buckets_as_theory_says_watched_or_not(lab):
    lab.run(SETUP, stream=False)
    result = lab.run(
        "reference = DDP(make(), bucket_cap_mb=2)\n"
        "eager = train(reference, reference)\n"
        "out = {}\n"
        "for cap in (2, 4, 100):\n"
        "    out[cap] = compiled_ddp(cap)[0]\n"
        "n_inner, w_inner, rec_inner = compiled_ddp(2, watched='inner')\n"
        "n_outer, w_outer, rec_outer = compiled_ddp(2, watched='compiled')\n"
        "n_one, w_one, rec_one = compiled_ddp(2, split=False, watched='compiled')\n"
        "close = lambda ws: max((a - b).abs().max().item() for a, b in zip(ws, eager))\n"
        "(out, n_inner, n_outer, n_one, close(w_inner), close(w_outer), close(w_one),\n"
        " [[b['bytes'] for b in r['allreduce']] for r in rec_inner[0]],\n"
        " [[b['bytes'] for b in r['allreduce']] for r in rec_outer[0]],\n"
        " [[b['bytes'] for b in r['allreduce']] for r in rec_one[0]], rec_inner[1], rec_outer[1] + rec_one[1])",
        stream=False, timeout=300,
    )
    model_bytes = 8 * LAYER_BYTES
    for rank in (0, 1):
        graphs, n_inner, n_outer, n_one, d_inner, d_outer, d_one, b_inner, b_outer, b_one, said, unsaid = result[rank]
        # DDPOptimizer cuts at the buckets, as the theory walks them: 5, 3 and 2 graphs.
        assert graphs == {cap: theory.compiled_ddp_graphs([LAYER_BYTES] * 8, cap * MiB) for cap in (2, 4, 100)}
        assert graphs == {2: 5, 4: 3, 100: 2}
        # Watching changes nothing about it, from inside the compiled module or from outside.
        assert n_inner == n_outer == graphs[2]
        assert n_one == 1  # optimize_ddp off: one graph
        # Watched from inside the compiled module, the watch says so; from outside, it has nothing to say.
        assert len(said) == 1 and "inside a torch.compile'd module" in said[0], said
        assert unsaid == []
        # The same training as eager DDP (aot_eager runs the same kernels, decomposed).
        assert max(d_inner, d_outer, d_one) < 1e-5
        # Every step's buckets were timed, and they hold every gradient (in one bucket in the first
        # step: DDP rebuilds its buckets in the order the first backward made the gradients).
        for buckets in (b_inner, b_outer, b_one):
            assert len(buckets) == 3
            assert all(sum(step) == model_bytes for step in buckets), buckets
            assert all(len(step) > 1 for step in buckets[1:]), buckets


FSDP = """
from torch.distributed.fsdp import fully_shard

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(256, 512), nn.Linear(512, 256)
    def forward(self, x):
        return x + self.down(self.up(x).relu())

class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

def fsdp(compile_blocks):
    torch._dynamo.reset()
    graphs.clear()
    torch.manual_seed(0)
    model = Blocks()
    for i, block in enumerate(model.blocks):
        if compile_blocks:  # torchtitan's order: each block compiled, then sharded
            model.blocks[i] = torch.compile(block, backend=counting, fullgraph=True)
        fully_shard(model.blocks[i])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    with distlab.watch(model, stats_every=0, checksum_every=0, publish=False) as w:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(32, 256, generator=g)).square().mean().backward()
            opt.step()
    ops = [sorted(collections.Counter(c["op"] for c in r["collectives"]).items()) for r in w.records()]
    return len(graphs), ops, [r["memory"]["peak_bytes"] for r in w.records()], w.notes
"""


def test_fsdp2_with_compiled_blocks_compiles_under_the_watch_and_shows_every_collective(lab):
    lab.run(SETUP + FSDP, stream=False)
    result = lab.run("(fsdp(False), fsdp(True))", stream=False, timeout=300)
    for rank in (0, 1):
        (eager_graphs, eager_ops, eager_peaks, _), (graphs, ops, peaks, notes) = result[rank]
        assert eager_graphs == 0
        # The watch's op observer lets torch.compile compile (with any other dispatch mode on the
        # stack it skips every frame, and the watched model ran uncompiled).
        assert graphs >= 1
        assert ops == eager_ops
        assert eager_ops[-1] == [("all_gather", 8), ("reduce_scatter", 4)]  # 4 blocks: forward, backward
        # aot_eager's ops run through the observer: the same tensors, give or take what the graph
        # frees earlier (2 KiB of 7.6 MB measured).
        assert all(abs(a - b) <= 0.01 * b for a, b in zip(peaks, eager_peaks)), (peaks, eager_peaks)
        assert notes == []


def test_a_model_watched_from_inside_its_compiled_module_says_so_and_its_later_steps_are_whole(lab):
    lab.run(SETUP + FSDP, stream=False)
    result = lab.run(
        "torch._dynamo.reset()\n"
        "torch.manual_seed(0)\n"
        "model = Blocks()\n"
        "for block in model.blocks:\n"
        "    fully_shard(block)\n"
        "fully_shard(model)\n"
        "run = torch.compile(model, backend=counting)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "with distlab.watch(model, stats_every=0, checksum_every=0, publish=False) as w:\n"
        "    for _ in range(3):\n"
        "        opt.zero_grad()\n"
        "        run(torch.randn(32, 256)).square().mean().backward()\n"
        "        opt.step()\n"
        "([sorted(collections.Counter(c['op'] for c in r['collectives']).items()) for r in w.records()], w.notes)",
        stream=False, timeout=300,
    )
    for rank in (0, 1):
        ops, notes = result[rank]
        assert len(notes) == 1 and "inside a torch.compile'd module" in notes[0], notes
        assert ops[1:] == [[("all_gather", 8), ("reduce_scatter", 4)]] * 2


def test_the_graphs_of_a_compiled_ddp_model_follow_ddps_buckets():
    # One op per layer, in forward order; buckets fill from the last layer, the first holding 1 MiB.
    assert theory.compiled_ddp_graph_bytes([LAYER_BYTES] * 8, 2 * MiB) == [LAYER_BYTES] + [2 * LAYER_BYTES] * 3 + [
        LAYER_BYTES]
    assert theory.compiled_ddp_graph_bytes([3.0, 2.0, 1.0], 100, first_bucket_bytes=1) == [5.0, 1.0]
    assert theory.compiled_ddp_graphs([1.0] * 10, 1e9, first_bucket_bytes=1e9) == 1
    assert theory.compiled_ddp_graphs([4 * MiB] * 6, 8 * MiB) == 4  # 1 | 2 | 2 | 1, from the end
    with pytest.raises(ValueError, match="first_bucket_bytes"):
        theory.compiled_ddp_graph_bytes([1.0], 1.0, first_bucket_bytes=2.0)
    with pytest.raises(ValueError, match="op_param_bytes"):
        theory.compiled_ddp_graph_bytes([1.0, -1.0], 1.0)
    assert collections.Counter(theory.compiled_ddp_graph_bytes([1.0] * 7, 2, first_bucket_bytes=1)) == {1.0: 1, 2.0: 3}

