# %% [markdown]
# # 08 · Cutting communication: gradient compression hooks
#
# DDP all-reduces every gradient, in fp32, every step. When that all-reduce is the slow part of the
# step, sending **fewer bytes** helps. DDP lets you replace its all-reduce with a **communication hook**,
# and PyTorch ships two kinds:
#
# * `fp16_compress_hook`: cast each bucket to fp16, all-reduce, cast back. Half the bytes, a small loss
#   of precision;
# * **PowerSGD** (`powerSGD_hook`; Vogels et al., 2019, "PowerSGD: Practical Low-Rank Gradient
#   Compression for Distributed Optimization"): approximate each gradient matrix `G` (n x m) by a
#   low-rank product `P Q^T` with rank r, and all-reduce `P` (n x r) and `Q` (m x r) instead of `G`. For
#   a 512 x 512 layer and r = 1 that is 1,024 numbers instead of 262,144. What the approximation
#   misses is kept and added to the next step's gradient (**error feedback**), so it is delayed, not
#   lost.
#
# Compression is not free: it costs computation on both ends, and it changes the gradient. It pays
# only when communication is a large part of the step. This lab measures both cases.
#
# The two ranks run on two emulated nodes (as in notebooks 03 and 12) joined by a link shaped to
# 100 Mbit/s each way, so the gradients cross a real link of known rate, as they do between machines.
# Where nodes cannot be made (neither root nor a user namespace: some containers, on Binder perhaps)
# the ranks talk through loopback instead, and the cell says so: loopback moves bytes about as fast as
# the CPUs compress them, so there the hooks mostly do not pay; the cells whose results need the link
# then also show what they printed in the run on nodes this notebook was saved from, marked `saved |`.

# %%
# %load_ext distlab
import distlab
from distlab.cluster.nodes import nodes_here
from distlab.notebook.saved import saved_from_nodes

# True where emulated nodes can be made; elsewhere False, after one line saying why not
on_nodes = nodes_here("2 ranks on loopback instead, so the times below are CPU copying, not a link")
saved = saved_from_nodes("08-compression")   # without nodes: what the cells printed on them, marked saved
nodes = "--nodes 2 --link 100mbit" if on_nodes else ""

# %%
# %dist start -n 2 {nodes}

# %% [markdown]
# ## The bytes each hook sends
#
# The model: four 512 x 512 linear layers, 1.05 M parameters, 4.2 MB of fp32 gradients, all in one
# DDP bucket. What one rank puts into all-reduces per step with each hook: fp32 sends `S`, fp16 `S/2`;
# PowerSGD sends, per weight matrix, `r (n + m)` numbers (P and Q, in fp32), and the biases
# uncompressed. It does so in three all-reduces (the uncompressed tensors, then all the P, then all
# the Q), where the others need one. With N = 2, the ring sends `2(N-1)/N` = 1 times each buffer.

# %%
import torch
from distlab import theory

lab = distlab.current_lab()
SHAPES = [(512, 512), (512,)] * 4                       # weight, bias of each layer
S = 4 * sum(torch.Size(s).numel() for s in SHAPES)      # fp32 gradient bytes


def allreduces(name):
    """The sizes in bytes of the all-reduces one step makes with this hook."""
    if name == "allreduce (fp32)":
        return [S]
    if name == "fp16_compress_hook":
        return [S // 2]
    r = int(name.split()[-1])
    matrices = [s for s in SHAPES if len(s) == 2]
    return [4 * sum(s[0] for s in SHAPES if len(s) == 1),              # biases, uncompressed
            4 * r * sum(n for n, _ in matrices), 4 * r * sum(m for _, m in matrices)]   # all P, all Q


HOOKS = ["allreduce (fp32)", "fp16_compress_hook", "powerSGD rank 1", "powerSGD rank 4"]
for name in HOOKS:
    sent = sum(allreduces(name))
    print(f"{name:>20}: {sent / 1e6:7.3f} MB per step in {len(allreduces(name))} all-reduce(s), "
          f"{S / sent:6.1f}x less than fp32")

# %% [markdown]
# ## A step that is mostly communication, and one that is mostly compute
#
# Same model, same link, two batch sizes. With a **batch of 8** the matrix multiplies take a few
# milliseconds and the 4.2 MB all-reduce (a third of a second at 100 Mbit/s) is nearly all of the
# step: communication-bound. With a **batch of 16,384** the forward and backward take about four times
# as long as the all-reduce: compute-bound. Each hook gets its own model, and a fifth model runs with
# no communication at all (`no_sync()`): the compute alone, the fastest any hook could possibly be.
#
# **Predict first**: over this 100 Mbit/s link (12.5 MB/s each way), how long will the all-reduce part
# of a step take with the fp16 hook? (Measured below as the fp16 step minus the compute-alone step.)

# %%
from distlab.quiz import predict

LINK = 12.5e6                                          # 100 Mbit/s in bytes per second
fp16_comm = predict("How many milliseconds of communication will one step with fp16_compress_hook add, "
                    "over this 100 Mbit/s link?", theory="ring_allreduce_time_s", unit="ms", tolerance=0.25,
                    size_bytes=S // 2, workers=2, bandwidth_bytes_per_s=LINK, latency_s=0.0)
fp16_comm

# %% [markdown]
# The ranks build the five models and run three warm-up steps of batch 8 on each (DDP settles its
# bucket in the first; PowerSGD starts compressing at the third). Then, for each batch size, the
# notebook drives the steps, one model after the other, in four rounds, so that every hook meets the same load on the
# machine, and it reads the link's counters around each step: `lab.link_bytes()` gives the bytes each
# node has sent onto its link so far (headers included, as notebook 12 explains). Each step begins
# with a barrier; the time kept is the slower rank's.
#
# All the gradients go in one bucket (`bucket_cap_mb=100`): with several buckets in flight,
# PowerSGD's chain of all-reduces (uncompressed vectors, then P, then Q, bucket by bucket) reaches gloo
# in a different order on each rank and the job aborts with a size mismatch. On NCCL, which runs
# collectives in the order they are issued on one stream, this does not happen.

# %%
# %%ddp
import contextlib
import time
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

torch.set_num_threads(1)                               # two ranks, two cores
HOOKS = ["allreduce (fp32)", "fp16_compress_hook", "powerSGD rank 1", "powerSGD rank 4"]
CONFIGS = ["no communication"] + HOOKS

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])

def with_hook(name):
    model = DDP(make().to(device), bucket_cap_mb=100)
    if name == "fp16_compress_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name.startswith("powerSGD"):
        state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2,
                                            matrix_approximation_rank=int(name.split()[-1]))
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return model

def step(name, batch):
    """One training step of this config's model on a batch of `batch`; the slower rank's seconds."""
    model, opt = models[name]
    steps[name] += 1                                   # every model sees the same data, step by step
    gen = torch.Generator().manual_seed(1000 * rank + steps[name])
    x, target = torch.randn(batch, 512, generator=gen).to(device), torch.randn(batch, 512, generator=gen).to(device)
    dist.barrier()
    t0 = time.perf_counter()
    with model.no_sync() if name == "no communication" else contextlib.nullcontext():
        loss = F.mse_loss(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
    opt.step()
    t = torch.tensor(time.perf_counter() - t0, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()

steps = {name: 0 for name in CONFIGS}
models = {name: with_hook(name) for name in CONFIGS}
models = {name: (m, torch.optim.SGD(m.parameters(), lr=0.01)) for name, m in models.items()}
for name in CONFIGS:
    for _ in range(3):
        step(name, 8)

# %%
import statistics

BATCHES, ROUNDS = (8, 16384), {8: 4, 16384: 4}
link_sent = {}                                         # (hook, batch): bytes on both links per step
times = {}                                             # (config, batch): step seconds, per round
for batch in BATCHES:
    for _ in range(ROUNDS[batch]):
        for name in ["no communication"] + HOOKS:
            before = lab.link_bytes() if on_nodes else {}
            t = lab.run(f"step({name!r}, {batch})", stream=False)[0]
            after = lab.link_bytes() if on_nodes else {}
            times.setdefault((name, batch), []).append(t)
            link_sent.setdefault((name, batch), []).append(sum(after[n] - before[n] for n in after))
step_time = {key: statistics.median(v) for key, v in times.items()}
# Speed-up over fp32 from each config's fastest round: other work on the machine only ever adds time,
# so the fastest round is the nearest to the unloaded step (a ratio round by round moved past 2x in
# CI when a burst of other work landed on fp32's steps in two rounds of three).
speedup = {(name, batch): min(times[("allreduce (fp32)", batch)]) / min(times[(name, batch)])
           for name, batch in times}

# %% [markdown]
# ## Measured against the model
#
# The model's step is the compute alone (measured, first row) plus the hook's all-reduces over the
# link (`theory.ring_allreduce_time_s` for each, at 12.5 MB/s, no latency term). It leaves out the
# compression's own computation, and the headers that share the link with the data (about 5%,
# notebook 12), so it is a floor.

# %%
print(f"{'':>20} {'batch 8':>38}   {'batch 16,384':>34}")
print(f"{'':>20} {'step (min-max)':>24} {'model':>7} {'ratio':>5}   {'step (min-max)':>22} {'model':>7} {'ratio':>5}")
model_time = {}
for name in ["no communication"] + HOOKS:
    row = f"{name:>20}"
    for batch in BATCHES:
        comm = 0.0 if name == "no communication" else sum(theory.ring_allreduce_time_s(b, 2, LINK) for b in allreduces(name))
        model_time[(name, batch)] = step_time[("no communication", batch)] + comm
        t, lo, hi = step_time[(name, batch)], min(times[(name, batch)]), max(times[(name, batch)])
        if batch == 8:
            row += f" {t * 1e3:6.1f} ms ({lo * 1e3:5.1f}-{hi * 1e3:5.1f})"
        else:
            row += f"   {t:5.2f} s ({lo:4.2f}-{hi:4.2f})"
        row += f" {model_time[(name, batch)] * 1e3:5.0f} ms {t / model_time[(name, batch)]:5.2f}"
    print(row)
for batch in BATCHES:
    gains = ", ".join(f"{n}: {speedup[(n, batch)]:.2f}x" for n in HOOKS[1:])
    print(f"\nbatch {batch}: speed-up over fp32 all-reduce (fastest round each): {gains}; "
          f"no communication at all: {speedup[('no communication', batch)]:.2f}x")
if not on_nodes:
    saved("steps against the model")
fp16_comm.reveal(step_time[("fp16_compress_hook", 8)] - step_time[("no communication", 8)])

# %% [markdown]
# How to read it. With a batch of 8 the step is the link's: fp32 takes about the model's time (5-15%
# more: mostly the headers, as notebook 12 counts them), fp16 about half of that, and PowerSGD sends so little that the link
# hardly matters; what is left of its step is the compute, the compression itself (a few matrix
# products, an orthogonalisation and the error feedback's passes over the gradients), and three
# all-reduces instead of one, each paying the latency. That is why its ratio to the model is large:
# the model counts only bytes on the link.
#
# With a batch of 16,384 the all-reduce is a small part of the step, so no hook can gain much: the
# compute-alone row is the limit, the speed-up you would get if communication cost nothing, and it is
# small. (A hook can land a little above it: these long steps vary by 10% or more from round to round
# on this shared machine, as the min-max shows.) This is Amdahl's law again: compression shrinks only the communication part, and what it
# costs in computation comes on top. Here nothing overlapped (one bucket); with DDP's overlap
# (notebook 03) much of the all-reduce of a compute-bound step hides behind backward (on GPUs, where
# communicating does not slow the computing, nearly all of it can), and compression buys even less.
#
# The bytes the links carried, per step (both nodes together; each sends what the ring model says,
# plus headers), against the model `2(N-1)/N * S` per rank:

# %%
print(f"{'hook':>20} {'model, both nodes':>18} {'on the links':>13} {'ratio':>6}")
sent_per_step = {}
for name in HOOKS:
    model_bytes = 2 * sum(theory.ring_allreduce_sent_bytes(b, 2) for b in allreduces(name))
    if on_nodes:
        sent_per_step[name] = statistics.median(link_sent[(name, 8)] + link_sent[(name, 16384)])
        print(f"{name:>20} {model_bytes / 1e6:>15.3f} MB {sent_per_step[name] / 1e6:>10.3f} MB "
              f"{sent_per_step[name] / model_bytes:>6.2f}")
    else:
        print(f"{name:>20} {model_bytes / 1e6:>15.3f} MB {'(no link)':>13}")
if not on_nodes:
    saved("bytes per step")

# %% [markdown]
# fp32 and fp16 put their data on the links plus about 5% of headers. PowerSGD's few kilobytes are
# joined by the small messages that always cross (the barrier before each step, the time kept, the
# notebook's own messages to the ranks), so its ratio is higher; the bytes are still a hundred times
# fewer than fp32's.

# %% tags=["nbval-check-output"]
fast = {name: speedup[(name, 8)] for name in HOOKS[1:]}
slow = {name: speedup[(name, 16384)] for name in HOOKS[1:]}


def under_2x_faster_than_fp32(name, batch=16384):
    """Whether fp32's step is under twice `name`'s: its median round is, or is past that by less than the
    rounds spread in this run (the most fp32's or `name`'s rounds differ). Other work on the machine adds
    time to some rounds more than to others: a gap that large is what the load made, not the link."""
    fp32, other = times[("allreduce (fp32)", batch)], times[(name, batch)]
    spread = max(max(fp32) - min(fp32), max(other) - min(other))
    return statistics.median(fp32) < 2 * statistics.median(other) + spread


if on_nodes:
    print("fp16 puts 45% to 55% of fp32's bytes on the links:",
          0.45 < sent_per_step["fp16_compress_hook"] / sent_per_step["allreduce (fp32)"] < 0.55)
    print("PowerSGD (rank 1 and 4) puts under 3% of fp32's bytes on the links:",
          all(sent_per_step[n] < 0.03 * sent_per_step["allreduce (fp32)"] for n in HOOKS[2:]))
    print("batch 8: fp16 is at least 1.5x faster than fp32:", fast["fp16_compress_hook"] > 1.5)
    print("batch 8: PowerSGD (rank 1 and 4) is at least 5x faster than fp32, and 2x faster than fp16:",
          all(fast[n] > 5 and fast[n] > 2 * fast["fp16_compress_hook"] for n in HOOKS[2:]))
    # The model's ceiling at batch 16,384 is 1 + all-reduce / compute, about 1.25x. The checks allow 2x,
    # plus the rounds' spread: these 1.5 s steps share the two cores with whatever else runs (a browser,
    # other tests beside this notebook in CI), which lengthens some rounds more than others. Only an
    # all-reduce as long as the compute, by more than the load moved the rounds, fails them.
    print("batch 16,384: even no communication at all would be under 2x faster than fp32, within the rounds'",
          "spread:", under_2x_faster_than_fp32("no communication"))
    # fp16's gain at batch 8 (1.5-2x) and a loaded round's at 16,384 can meet: only PowerSGD's 5x
    # stands clear of the spread, so only it is compared across batches.
    print("batch 16,384: no hook is 2x faster than fp32 (within the rounds' spread), and PowerSGD gains less "
          "than at batch 8:",
          all(under_2x_faster_than_fp32(n) for n in HOOKS[1:]) and all(slow[n] < fast[n] for n in HOOKS[2:]))
else:
    print("no link here: loopback is about as fast as compressing, nothing to check")
    saved("checks")

# %% [markdown]
# On a real cluster the balance is set the same way, by the compute/communication ratio: a GPU
# computes and compresses at hundreds of GB/s, while the links between nodes carry 1 to 50 GB/s.
# Rules of thumb:
#
# * compression helps when the compute/communication ratio is low: big models on slow links
#   (Ethernet between nodes), small per-device batches, many workers;
# * it does not help when the step is compute-bound, when communication already hides behind
#   backward (DDP's overlap, notebook 03; here everything was one bucket, so nothing overlapped), on
#   fast links (NVLink, InfiniBand, loopback), when compressing costs as much as sending, or when the
#   gradients are small enough that latency, not bandwidth, dominates (notebook 03);
# * it changes the optimisation: fp16 rounds (and can underflow tiny gradients), PowerSGD approximates.
#   Check that the model still reaches the same quality.
#
# Whatever the hook, the replicas must stay identical: every rank decompresses the same all-reduced
# data. And the further the compression, the further the weights move from the uncompressed run's:

# %%
lab.run("weights = {name: [p.detach().cpu().clone() for p in m.module.parameters()]"   # CPU: for the notebook
        " for name, (m, _) in models.items()}")
weights = lab.pull("weights")


def distance(a, b):
    return (sum((x - y).pow(2).sum() for x, y in zip(a, b)) ** 0.5).item()


ref = weights[0]["allreduce (fp32)"]
print(f"distance of the weights from the fp32 run after {3 + sum(ROUNDS.values())} steps: " + ", ".join(
    f"{n} {distance(weights[0][n], ref):.2e}" for n in HOOKS[1:]))

# %% tags=["nbval-check-output"]
identical = all(torch.equal(a, b) for name in HOOKS for a, b in zip(weights[0][name], weights[1][name]))
print("replicas identical under every hook:", identical)
order = [distance(weights[0][n], weights[0]["allreduce (fp32)"]) for n in HOOKS[1:3]]
print("PowerSGD rank 1 moves further from fp32 than fp16 does:", order[1] > order[0])

# %% [markdown]
# The same trade-off in the cost model: compression divides the bandwidth term `2(N-1)/N * S/B` by the
# compression factor and leaves the latency term alone, so for a 400 MB gradient on 4 workers and a
# 25 GB/s link:

# %% tags=["nbval-check-output"]
for name, factor in (("fp32", 1), ("fp16", 2), ("PowerSGD, 100x", 100)):
    t = theory.ring_allreduce_time_s(400e6 / factor, workers=4, bandwidth_bytes_per_s=25e9, latency_s=5e-6)
    print(f"{name:>15}: all-reduce in milliseconds: {round(t * 1e3, 3)}")

# %% [markdown]
# If the backward pass takes 100 ms, even the fp32 all-reduce (24 ms) can hide behind it with DDP's
# bucketing, and compression buys nothing; if the backward takes 5 ms, compression is what makes
# scaling possible.
#
# ## Practice

# %%
# %quiz communication-cost -n 3

# %%
# %dist stop
