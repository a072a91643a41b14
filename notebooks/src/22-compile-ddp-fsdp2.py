# %% [markdown]
# # 22 · torch.compile with DDP and FSDP2: where the graphs are cut
#
# `torch.compile` turns a model's forward into graphs: TorchDynamo captures the Python code as a
# graph, AOTAutograd derives the backward graph from it, and a backend (inductor, by default)
# compiles both. Data parallelism adds a catch:
#
# - **DDP** overlaps communication with backward: the reducer all-reduces a bucket as soon as
#   backward has produced all of its gradients (notebook 03). A compiled backward, though, is *one*
#   autograd node: every gradient appears at once, when the whole graph has run, and every bucket
#   is launched at the end. No overlap is left. TorchDynamo's **DDPOptimizer** therefore cuts the
#   forward into one graph per bucket (`torch/_dynamo/backends/distributed.py`, on while
#   `torch._dynamo.config.optimize_ddp` is set, the default). The backward of each piece then ends
#   where a bucket is complete, and the reducer launches it while the earlier pieces still run.
# - **FSDP2** gathers each block's weights in a hook before the block's forward and reduce-scatters
#   its gradients after its backward. TorchDynamo does not trace these hooks. torchtitan compiles
#   each transformer block on its own, then shards it (`apply_compile`, then `apply_fsdp`): the
#   collectives stay between the graphs.
#
# On 2 ranks we count the graphs, look at when each bucket was launched, and check that compiled
# training computes what eager training does. The backend here is `aot_eager`: the same graphs,
# cut in the same places, run with the eager kernels. Inductor would also generate code for them,
# which takes tens of seconds per rank on this machine's CPU (19 s measured for a small MLP).

# %%
# %load_ext distlab
# %dist start -n 2

# %%
import distlab
from distlab import theory

lab = distlab.current_lab()

# %% [markdown]
# ## DDP: one graph per bucket
#
# The model is 8 linear layers of 1024 x 1024 (4.2 MB of fp32 weights and bias each, 33.6 MB in
# all), wrapped in DDP with `bucket_cap_mb=8`. DDPOptimizer walks the ops from the last to the
# first, as backward will produce their gradients. It closes the first bucket once it holds 1 MiB
# (DDP's `_DEFAULT_FIRST_BUCKET_BYTES`, small so that the first all-reduce starts early) and every
# later bucket once it holds 8 MiB. Each bucket becomes a graph.
#
# **Predict first**: into how many graphs will `torch.compile` cut this model's forward?

# %%
from distlab.quiz import predict

LAYER = (1024 * 1024 + 1024) * 4                        # one layer's weight and bias, in bytes
graphs_q = predict("Into how many graphs will torch.compile cut the forward of 8 such layers under DDP "
                   "with bucket_cap_mb=8?", theory="compiled_ddp_graphs", tolerance=0.01,
                   op_param_bytes=[LAYER] * 8, bucket_cap_bytes=8 * 2**20)
graphs_q

# %% [markdown]
# Four runs of the same training, 6 steps each, watched by `distlab.watch` (each bucket's
# all-reduce timed: when it was launched, how long it took):
#
# 1. **eager**: DDP as ever;
# 2. **compiled, cut at buckets**: `torch.compile(ddp_model)`, DDPOptimizer on;
# 3. **compiled, one graph**: the same with `optimize_ddp = False`;
# 4. **compiled nn.Sequential**: the same layers in an `nn.Sequential` instead of a class of our
#    own, DDPOptimizer on.
#
# The backend counts the graphs it is given before `aot_eager` runs them. The watch is given the
# compiled module, not the DDP module inside it: a hook on a module inside a compiled one runs
# inside the compiled call (the watch says so if you do it).

# %%
# %%ddp
import statistics
import torch._dynamo
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)                                 # two ranks, two cores
LAYERS, WIDTH, BATCH, CAP_MB, STEPS = 8, 1024, 512, 8, 6
graphs = []


def counting(gm, example_inputs):
    """A torch.compile backend: keeps the graph it is given, then lets aot_eager compile it."""
    graphs.append(gm)
    return lookup_backend("aot_eager")(gm, example_inputs)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x


def make(kind):
    torch.manual_seed(0)
    if kind == "compiled nn.Sequential":
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)]).to(device)
    return Stack().to(device)


def train_ddp(kind):
    torch._dynamo.reset()
    graphs.clear()
    torch._dynamo.config.optimize_ddp = kind != "compiled, one graph"
    model = DDP(make(kind), bucket_cap_mb=CAP_MB)
    run = model if kind == "eager" else torch.compile(model, backend=counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    with distlab.watch(run, stats_every=0, checksum_every=0, publish=False) as w:
        for _ in range(STEPS):
            x = torch.randn(BATCH, WIDTH, generator=g).to(device)
            opt.zero_grad()
            run(x).square().mean().backward()
            opt.step()
    torch._dynamo.config.optimize_ddp = True
    steps = w.records()[2:]                              # the first two compile, and DDP rebuilds its buckets
    launches = [[b["start_s"] for b in r["allreduce"]] for r in steps]
    return {
        "graphs": len(graphs),
        "buckets (MB)": [b["bytes"] / 1e6 for b in steps[-1]["allreduce"]],
        "launch spread (ms)": statistics.median(1e3 * (max(t) - min(t)) for t in launches),
        "last launch (ms)": statistics.median(1e3 * max(t) for t in launches),
        "step (ms)": statistics.median(1e3 * r["step_time_s"] for r in steps),
        "exposed all-reduce (ms)": statistics.median(1e3 * r["comm_s"] for r in steps),
        "weights": [p.detach().cpu().clone() for p in model.parameters()],   # CPU: for the notebook
    }


KINDS = ["eager", "compiled, cut at buckets", "compiled, one graph", "compiled nn.Sequential"]
ddp_runs = {kind: train_ddp(kind) for kind in KINDS}

# %%
ddp_runs = lab.pull("ddp_runs")[0]                      # rank 0's (rank 1's buckets were launched alike)
KINDS = ["eager", "compiled, cut at buckets", "compiled, one graph", "compiled nn.Sequential"]
graphs_q.reveal(ddp_runs["compiled, cut at buckets"]["graphs"])
print(f"{'':>24} {'graphs':>6} {'buckets (MB), as launched':>34} {'launch spread':>13} {'last launch':>11} "
      f"{'step':>7} {'exposed':>8}")
for kind in KINDS:
    r = ddp_runs[kind]
    buckets = ", ".join(f"{b:.3g}" for b in r["buckets (MB)"])
    print(f"{kind:>24} {r['graphs']:>6} {buckets:>34} {r['launch spread (ms)']:>10.0f} ms {r['last launch (ms)']:>8.0f} ms "
          f"{r['step (ms)']:>4.0f} ms {r['exposed all-reduce (ms)']:>5.0f} ms")
on_gpu = lab.status()[0].device.startswith("cuda")
if on_gpu:
    print("on a GPU this backward is queued in a millisecond or two: the launches have nothing to spread over, "
          "so the spread is not checked below")

# %% [markdown]
# How to read it (medians of steps 3 to 6; the times are measured, so they move from run to run):
#
# - **graphs**: the cut at the buckets gives what the theory's walk predicts; with DDPOptimizer off
#   the forward is one graph. The `nn.Sequential` gave **none**: torch.compile compiles frames of
#   Python code, DDP's forward breaks the graph where it calls the module inside (a context manager
#   torch marks as not to be traced), and the `nn.Sequential.forward` left to compile is torch's own
#   code, which TorchDynamo skips when it is the first frame. That model ran eagerly, silently
#   (torch 2.13; put the layers in a class of your own, as most models are).
# - **launch spread**: from the first bucket's launch to the last. Eager DDP and the graphs cut at
#   the buckets launch theirs across backward. One graph launches them all together, when its
#   whole backward has run. That is on CPU ranks: on a GPU the host queues this small backward's
#   kernels in a millisecond or two, and every run's launches fall inside that (two ranks sharing an
#   H200, on gloo with CUDA tensors since NCCL refuses two ranks on one GPU: 1-2 ms of spread in all
#   four runs).
# - **buckets**: eager DDP rebuilds its buckets after the first step, in the order the gradients
#   arrived: four of two layers. Compiled, the gradients arrive graph by graph, in another order,
#   which leaves a bias or two in a last bucket of a few kilobytes.
# - **exposed all-reduce**: what the step waited for after its last bucket was launched. One graph
#   waits for all its buckets one after the other (36 ms in the run saved above: four 8 MB buckets);
#   the others wait for the last bucket only (9-13 ms above). On loopback an 8 MB all-reduce takes
#   about 10 ms, so four take about 40; over a slower link (notebook 12) the gap grows with it.

# %% tags=["nbval-check-output"]
cut, one = ddp_runs["compiled, cut at buckets"], ddp_runs["compiled, one graph"]
eager_w = ddp_runs["eager"]["weights"]
print("cut at the buckets: as many graphs as the theory predicts:",
      cut["graphs"] == theory.compiled_ddp_graphs([LAYER] * 8, 8 * 2**20))
print("optimize_ddp off: one graph; the nn.Sequential: none at all:",
      (one["graphs"], ddp_runs["compiled nn.Sequential"]["graphs"]) == (1, 0))
print("every compiled run trains to eager DDP's weights (within 1e-5):",
      all(max((a - b).abs().max().item() for a, b in zip(r["weights"], eager_w)) < 1e-5 for r in ddp_runs.values()))
# Tens of milliseconds of backward between bucket launches against launches a few ms apart: a factor
# of 4 leaves room for a loaded machine's bursts. On a GPU the host queues the whole backward in a
# millisecond or two (two gloo ranks on an H200: 1-2 ms of spread in all four runs), so this holds for
# CPU ranks only.
print("one graph launches its buckets together; cut at the buckets, they spread over backward (4x more), on CPU ranks:",
      on_gpu or cut["launch spread (ms)"] > 4 * one["launch spread (ms)"])

# %% [markdown]
# The bucket cap sets the cut. With `bucket_cap_mb=100`, the whole model but the first bucket fits
# in one bucket, so DDPOptimizer makes 2 graphs, and there are 2 all-reduces. The more buckets, the
# more graphs: each graph is compiled on its own, and inductor cannot fuse across the cut.
# `theory.compiled_ddp_graph_bytes` gives the parameter bytes of each graph:

# %%
for cap_mb in (2, 8, 32, 100):
    sizes = theory.compiled_ddp_graph_bytes([LAYER] * 8, cap_mb * 2**20)
    print(f"bucket_cap_mb={cap_mb:>3}: {len(sizes)} graphs of " + ", ".join(f"{s / 1e6:.1f}" for s in sizes) + " MB")

# %% [markdown]
# There is a second way, **compiled autograd** (`torch._dynamo.config.optimize_ddp =
# "python_reducer"` with `torch._dynamo.config.compiled_autograd = True`): DDP then hands its
# all-reduces to the traced backward, and inductor places the buckets itself
# (`torch._inductor.config._fuse_ddp_communication`). It needs the whole backward traced, which is
# what CUDA runs use it for; this lab stays with DDPOptimizer.
#
# ## FSDP2: compile the blocks, then shard them
#
# Four residual blocks (1024 -> 2048 -> 1024), each sharded with `fully_shard`, in three versions:
#
# 1. **eager**;
# 2. **whole model compiled**: `torch.compile(model)` after sharding;
# 3. **blocks compiled**: each block compiled with `fullgraph=True` (fail rather than break the
#    graph), then sharded, as torchtitan does.
#
# The watch records each step's collectives: FSDP2 all-gathers a block's weights before its forward
# and again before its backward, and reduce-scatters its gradients after.

# %%
# %%ddp
import collections
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(1024, 2048), nn.Linear(2048, 1024)

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


def train_fsdp(kind):
    torch._dynamo.reset()
    graphs.clear()
    torch.manual_seed(0)
    model = Blocks().to(device)
    for i, block in enumerate(model.blocks):
        if kind == "blocks compiled":
            model.blocks[i] = torch.compile(block, backend=counting, fullgraph=True)
        fully_shard(model.blocks[i])
    fully_shard(model)
    run = torch.compile(model, backend=counting) if kind == "whole model compiled" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    with distlab.watch(run, stats_every=0, checksum_every=0, publish=False) as w:
        for _ in range(4):
            x = torch.randn(256, 1024, generator=g).to(device)
            opt.zero_grad()
            run(x).square().mean().backward()
            opt.step()
    last = w.records()[-1]
    return {
        "graphs": len(graphs),
        # Why TorchDynamo compiled a frame again: the guard of the graph it had that failed.
        "recompiled for": [why for reasons in torch._dynamo.utils.guard_failures.values() for why in reasons],
        "collectives": dict(sorted(collections.Counter(c["op"] for c in last["collectives"]).items())),
        "bytes": sum(c["bytes"] for c in last["collectives"]),
        "weights": [p.full_tensor().detach().cpu() for p in model.parameters()],   # whole, on the CPU
    }


fsdp_runs = {kind: train_fsdp(kind) for kind in ["eager", "whole model compiled", "blocks compiled"]}

# %%
fsdp_runs = lab.pull("fsdp_runs")[0]
print(f"{'':>22} {'graphs':>6} {'collectives in a step':>32} {'MB':>6}   recompiled for")
for kind in ["eager", "whole model compiled", "blocks compiled"]:
    r = fsdp_runs[kind]
    ops = ", ".join(f"{n} {op}" for op, n in r["collectives"].items())
    print(f"{kind:>22} {r['graphs']:>6} {ops:>32} {r['bytes'] / 1e6:>6.1f}   {'; '.join(r['recompiled for'])}")

# %% [markdown]
# Both compiled versions made the same **2 graphs**, one block's forward each time, used by all four
# blocks (their code is the same; the weights are inputs). Two, not one: the first block's input
# is the batch, which needs no gradient, and the other blocks' inputs do, so TorchDynamo compiled
# the block a second time for them (a recompilation on a `requires_grad` guard).
#
# The whole model compiled came to the same graphs another way: TorchDynamo could not trace into
# FSDP2's hooks, gave up on the loop over the blocks (a graph break inside a loop makes it run that
# whole frame eagerly), and compiled each block's forward as a frame of its own. Compiling the
# blocks says so outright, and `fullgraph=True` makes sure no graph break hides inside one.
#
# The collectives are FSDP2's in all three: 8 all-gathers (4 blocks, before forward and before
# backward) and 4 reduce-scatters. Compiling changed what runs inside the blocks, not what crosses
# between the ranks.

# %% tags=["nbval-check-output"]
eager = fsdp_runs["eager"]
print("the same collectives in every version (8 all-gathers, 4 reduce-scatters):",
      all(r["collectives"] == eager["collectives"] == {"all_gather": 8, "reduce_scatter": 4}
          for r in fsdp_runs.values()))
print("both compiled versions: 2 graphs, the second for an input that needs a gradient:",
      all(fsdp_runs[k]["graphs"] == 2 and len(fsdp_runs[k]["recompiled for"]) == 1
          and "requires_grad" in fsdp_runs[k]["recompiled for"][0] for k in ("whole model compiled", "blocks compiled")))
print("every version trains to eager's weights (within 1e-5):",
      all(max((a - b).abs().max().item() for a, b in zip(r["weights"], eager["weights"])) < 1e-5
          for r in fsdp_runs.values()))

# %% [markdown]
# ## Watching a compiled model
#
# The dashboard follows a compiled model as it follows any other. Here the compiled DDP model of
# the first part trains for 12 steps, watched live: each step's buckets (launched across the
# backward of the five graphs), the loss and the memory.

# %%
# %%ddp
torch._dynamo.reset()
model = DDP(make("compiled, cut at buckets"), bucket_cap_mb=CAP_MB)
run = torch.compile(model, backend=counting)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
with distlab.watch(run, stats_every=4, checksum_every=4):
    for _ in range(12):
        x = torch.randn(BATCH, WIDTH, generator=g).to(device)
        opt.zero_grad()
        loss = run(x).square().mean()
        loss.backward()
        opt.step()
        distlab.log(loss=loss)

# %% [markdown]
# ## What to remember
#
# - Compile **after** wrapping in DDP: `torch.compile(DDP(model))`. DDPOptimizer then cuts the
#   graph at the buckets so that all-reduce still overlaps backward. Without the cut, every bucket
#   waits for the whole backward.
# - Check that something was compiled: a model whose top is torch's own `nn.Sequential` compiled
#   nothing under DDP here, with no warning. `torch._dynamo.explain`, or a backend that counts
#   graphs as this one does, tells you.
# - FSDP2: compile each block, then `fully_shard` it; the collectives stay outside the graphs,
#   where FSDP2's hooks and prefetching put them.
# - Watch the compiled module (`distlab.watch(compiled)`), not a module inside it.

# %%
# %quiz communication-cost -n 3 --seed 22

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise ddp-comm-hook`: DDP's averaging of one bucket written as a communication hook (the
#   place where the compiled DDP above, like eager DDP, all-reduces each bucket), started without
#   waiting and returned as a future, checked against DDP's default over several buckets.

# %%
# %dist stop
