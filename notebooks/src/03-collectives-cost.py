# %% [markdown]
# # 03 · Collectives and what they cost
#
# Every data-parallel step ends in an all-reduce of the gradients, so its cost is paid on every
# step. This lab measures it, fits the standard cost model to the measurements, and then looks at
# how DDP packs gradients into **buckets**: what a bucket costs, what it buys, and what it holds.
#
# The model for a ring all-reduce of `S` bytes over `N` workers, on links of bandwidth `B` with a
# latency `a` for each step of the ring:
#
# $$T \approx \frac{2(N-1)}{N}\cdot\frac{S}{B} + 2(N-1)\,a$$
#
# The ring all-reduce is a reduce-scatter (each worker ends up owning the sum of one slice) followed
# by an all-gather (the summed slices are passed round), N-1 steps each, one after another (Thakur,
# Rabenseifner and Gropp 2005). In each step every worker sends one slice of `S/N` bytes to its
# neighbour, so each worker sends (and receives) `2(N-1)/N` of the buffer in all, and each of the
# `2(N-1)` steps waits for its message: the latency term. Small messages are dominated by the latency
# term, large ones by the bandwidth term.
#
# The two ranks run on two **emulated nodes** (network namespaces, as in notebook 12) joined by a
# link shaped to 100 Mbit/s each way, so the bytes cross a real, slow link whose rate we know, as
# gradients do between machines. Making nodes takes root's CAP_NET_ADMIN or, for a user without it, a
# user namespace of the lab's own, which most Linux machines allow. Where neither can be had (some
# containers, on Binder perhaps) the cell below says so and the ranks talk through loopback instead:
# everything still runs, but the times then measure the CPU copying bytes, not a link; so each cell
# whose result needs the link also shows what it printed in the run on nodes this notebook was saved
# from, every line marked `saved |`.

# %%
# %load_ext distlab
import distlab
from distlab.cluster.nodes import nodes_here
from distlab.notebook.saved import saved_from_nodes

# True where emulated nodes can be made; elsewhere False, after one line saying why not
on_nodes = nodes_here("2 ranks on loopback instead, so the times below are CPU copying, not a link")
saved = saved_from_nodes("03-collectives-cost")   # without nodes: what the cells printed on them, marked saved
nodes = "--nodes 2 --link 100mbit" if on_nodes else ""

# %% [markdown]
# IPython fills `{nodes}` in before the magic runs: with nodes the line reads
# `%dist start -n 2 --nodes 2 --link 100mbit`, one rank on each node.

# %%
# %dist start -n 2 {nodes}

# %% [markdown]
# ## Predict, then measure
#
# The link carries 100 Mbit/s each way: `B` = 12.5 MB/s (1 MB = 10^6 bytes; buffer sizes below are
# in KiB and MiB, powers of 2). With N = 2, each rank sends `2(N-1)/N * S = S` bytes. Before the
# measurement, commit your estimate (the widget grades it against the ring model, leaving the latency
# out):

# %%
import torch
from distlab import theory
from distlab.quiz import predict

lab = distlab.current_lab()
MB = 1 << 20                                           # buffer sizes: MiB
LINK = 12.5e6                                          # 100 Mbit/s in bytes per second
big = predict("How long will an all-reduce of 4 MiB (4,194,304 bytes) take between the two nodes?",
              theory="ring_allreduce_time_s", unit="ms", tolerance=0.25,
              size_bytes=4 * MB, workers=2, bandwidth_bytes_per_s=LINK, latency_s=0.0)
big

# %% [markdown]
# ## Measuring all-reduce over sizes
#
# Each rank all-reduces buffers from 256 bytes to 4 MiB, several times each after a warm-up. A collective
# ends at about the same moment everywhere, but a rank can *start* early and wait for the other, so
# each repetition begins with a barrier, and the time kept is the slower rank's median (with the
# fastest and slowest runs, to show the spread). Each rank computes with one thread: two ranks, two
# cores.

# %%
# %%ddp
import time
torch.set_num_threads(1)

def timed(fn, repeats):
    """(median, min, max) seconds of fn() over `repeats` runs after a warm-up, each after a barrier;
    the slower rank's."""
    runs = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    runs = sorted(runs[1:])
    t = torch.tensor([runs[len(runs) // 2], runs[0], runs[-1]], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()

for _ in range(20):                                    # wake the connections up before timing
    dist.all_reduce(torch.ones(64, device=device))
sizes = [256 * 4**k for k in range(8)]                 # bytes: 256 B, 1 KiB, 4 KiB, ..., 4 MiB
timings = []                                           # (size_bytes, median, min, max)
for size in sizes:
    buf = torch.ones(size // 4, device=device)         # float32: 4 bytes each
    timings.append((size, *timed(lambda: dist.all_reduce(buf), 9 if size < 1 << 20 else 5)))

# %%
timings = lab.pull("timings", ranks=0)[0]
t_of = {size: t for size, t, _, _ in timings}
fit = theory.fit_latency_bandwidth([(size, t) for size, t, _, _ in timings], workers=2)
print(f"fitted: bandwidth B = {fit.bandwidth_bytes_per_s / 1e6:.2f} MB/s"
      + (f" ({fit.bandwidth_bytes_per_s / LINK:.0%} of the link's 12.5 MB/s)" if on_nodes else "")
      + f", latency a = {fit.latency_s * 1e3:.2f} ms\n")
print(f"{'size':>8} {'measured (min-max)':>24} {'ring model':>11} {'algbw':>11} {'busbw':>11}")
for size, t, lo, hi in timings:
    label = f"{size} B" if size < 1024 else f"{size // 1024} KiB" if size < MB else f"{size // MB} MiB"
    print(f"{label:>8} {t * 1e3:>8.2f} ms ({lo * 1e3:6.2f}-{hi * 1e3:6.2f}) {fit.allreduce_time_s(size, 2) * 1e3:>8.2f} ms "
          f"{theory.algbw_bytes_per_s(size, t) / 1e6:>6.2f} MB/s {theory.busbw_bytes_per_s(size, t, 2) / 1e6:>6.2f} MB/s")
if not on_nodes:
    saved("all-reduce by size")
big.reveal(t_of[4 * MB])

# %% [markdown]
# Two bandwidths are in the table. **algbw** is the buffer size over the time: what the
# application sees. **busbw** = algbw x 2(N-1)/N corrects for the share of the buffer each worker
# really sends, so it can be compared with the link's speed whatever the number of workers (with
# N = 2 the factor is 1, and the two are equal; nccl-tests, `doc/PERFORMANCE.md`).
#
# At the large end, time grows in proportion to size and busbw settles a little below the link's
# 12.5 MB/s: a frame of 1,514 bytes on the link carries 1,448 bytes of data, the rest is Ethernet, IP
# and TCP headers (notebook 12 counts them), so at most 96% of the link is data.
#
# At the small end the time hardly changes with the size: that is the latency floor, where a few
# hundred bytes use a few percent of the link (how few is the machine's latency: the check below
# asks for under half). It is well under a millisecond in the fastest runs
# (the min column) and a few milliseconds when the two cores are busy with something else at that
# moment (the max column): small messages are where a shared machine's noise shows most, and their
# medians jump about from one size to the next. In between, a 16 or 64 KiB all-reduce can even show a
# busbw above the link's rate: the link is shaped by a token bucket (`tc`'s `tbf`) that saves up to
# 32 KiB of credit while the link is idle and then lets that much through at once.
#
# The small sizes sit above the fitted line: fitted over every size, least squares is ruled by the big
# transfers, where a millisecond is lost in their noise, so the fitted `a` says little. It is measured
# where it dominates, just below.

# %% tags=["nbval-check-output"]
if on_nodes:
    # The fastest runs: what a busy core adds to a run (a few ms, now and then) is not the link's.
    fastest = {size: lo for size, _, lo, _ in timings}
    print("at the large end, 4x the bytes costs 3.5x to 4.5x the time (bandwidth, fastest runs):",
          3.5 < fastest[4 * MB] / fastest[1 * MB] < 4.5)
    print("busbw at 4 MiB is 80% to 100% of the link's rate:",
          0.8 < theory.busbw_bytes_per_s(4 * MB, t_of[4 * MB], 2) / LINK < 1.0)
    # Under half: the latency floor is at least the bytes' own time at the link's rate (20 us for 256 B
    # at 12.5 MB/s). How far under is the machine's: 6% in the saved run, 10% or more on CI's machine.
    print("busbw at 256 B is under half the link's rate (latency):",
          theory.busbw_bytes_per_s(256, t_of[256], 2) / LINK < 0.5)
else:
    saved("the link's rate")
print("a 4 MiB all-reduce takes longer than a 256 B one:", t_of[4 * MB] > t_of[256])

# %% [markdown]
# The model in numbers for a bigger machine, from `distlab.theory`: 4 workers, a 400 MB gradient,
# 25 GB/s links, 5 us latency. The bandwidth term is 1.5 x 16 ms = 24 ms, the latency term
# 2(N-1) = 6 steps of 5 us, 30 us:

# %% tags=["nbval-check-output"]
t = theory.ring_allreduce_time_s(400e6, workers=4, bandwidth_bytes_per_s=25e9, latency_s=5e-6)
print("ring all-reduce, milliseconds:", round(t * 1e3, 3))
print("bytes each worker sends, MB:", theory.ring_allreduce_sent_bytes(400e6, 4) / 1e6)

# %% [markdown]
# ## Many tiny tensors: the latency trap
#
# Reducing 256 small tensors one at a time pays the latency term 256 times; flattening them into one
# buffer pays it once. Same bytes, so the difference between the two is 255 latency terms: that is how
# `a` is measured here. With N = 2 an all-reduce is one step of reduce-scatter and one of all-gather,
# so each pays `2(N-1) a = 2a`, and `a` is the difference over 2 x 255.

# %%
# %%ddp
tensors = [torch.ones(256, device=device) for _ in range(256)]   # 256 x 1 KiB
flat = torch.cat(tensors)                              # 256 KiB

def one_by_one():
    for t in tensors:
        dist.all_reduce(t)

one_by_one_s = timed(one_by_one, 5)
at_once_s = timed(lambda: dist.all_reduce(flat), 9)                # 20 ms or so each: cheap to repeat

# %%
one_by_one_s, at_once_s = lab.pull("one_by_one_s", ranks=0)[0], lab.pull("at_once_s", ranks=0)[0]
latency = (one_by_one_s[0] - at_once_s[0]) / (2 * 255)    # 255 more all-reduces, 2(N-1) = 2 steps each
print(f"256 all-reduces of 1 KiB: {one_by_one_s[0] * 1e3:.0f} ms ({one_by_one_s[1] * 1e3:.0f}-{one_by_one_s[2] * 1e3:.0f}); "
      f"one of 256 KiB: {at_once_s[0] * 1e3:.1f} ms ({at_once_s[1] * 1e3:.1f}-{at_once_s[2] * 1e3:.1f})")
print(f"flattening made it {one_by_one_s[0] / at_once_s[0]:.0f}x faster; "
      f"the latency: a = (difference) / (2 x 255) = {latency * 1e3:.2f} ms per step, {2 * latency * 1e3:.2f} ms per all-reduce")

# %% tags=["nbval-check-output"]
# The fastest rounds: other work on the machine only ever slows a round. The same bytes cross the link
# either way, so what the 256 small ones add is 255 more latency terms: how many times slower that
# makes them depends on the machine's latency (10x in the saved run, under 3x on a machine with less).
print("256 small all-reduces take longer than one flat one of the same bytes:", at_once_s[1] < one_by_one_s[1])

# %% [markdown]
# On this machine the latency, about a millisecond per all-reduce (0.7 ms in the run above, 1.6 ms in
# an earlier one), is mostly not the wire: it is two
# processes on two cores waking up, passing through the kernel's network stack, and gloo's
# handshakes, and it varies with whatever else the cores are doing (the spread in brackets). On GPUs
# with NCCL, `a` is a few microseconds within a node and tens of microseconds between nodes, and `B`
# tens to hundreds of GB/s; the trap is the same, at a smaller scale.
#
# ## Buckets pay the latency once each
#
# DDP does the flattening for you. It groups gradients into **buckets** of about `bucket_cap_mb`
# megabytes and all-reduces each bucket as one flat buffer. The same 1 MiB of "gradients" below goes
# out in 1, 4, 16, 64 or 256 buckets, one all-reduce after another; the five are measured in turn,
# five rounds, so that they share whatever load the machine has. The model
# (`theory.bucketed_allreduce_time_s`) pays the bandwidth term once for the whole MiB, with the `B`
# fitted above, and the latency term once per bucket: `T(k) = S/B + 2k a` for N = 2 (each bucket's
# all-reduce is 2(N-1) = 2 steps). It is a straight line in the number of buckets `k`; its slope `2a`
# is fitted to these five points (least squares).

# %%
# %%ddp
TOTAL = 1 << 20
COUNTS = (1, 4, 16, 64, 256)
split = {k: [torch.ones(TOTAL // 4 // k, device=device) for _ in range(k)] for k in COUNTS}
rounds = {k: [] for k in COUNTS}
for r in range(6):                                     # round 0 is a warm-up
    for k in COUNTS:
        dist.barrier()
        t0 = time.perf_counter()
        for b in split[k]:
            dist.all_reduce(b)
        rounds[k].append(time.perf_counter() - t0)
t = torch.tensor([[sorted(rounds[k][1:])[2], min(rounds[k][1:]), max(rounds[k][1:])] for k in COUNTS], device=device)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
bucket_times = [(k, *row) for k, row in zip(COUNTS, t.tolist())]     # (buckets, median, min, max)

# %%
bucket_times = lab.pull("bucket_times", ranks=0)[0]
B = fit.bandwidth_bytes_per_s
measured = {k: t for k, t, _, _ in bucket_times}
bandwidth_term = theory.ring_allreduce_time_s(MB, 2, B)
slope = max(0.0, sum(k * (t - bandwidth_term) for k, t in measured.items()) / sum(k * k for k in measured))
a_fit = slope / 2                                      # a bucket's all-reduce is 2(N-1) = 2 steps of the ring
model = {k: theory.bucketed_allreduce_time_s(MB, MB / k, 2, B, a_fit) for k in measured}
print(f"bandwidth term S/B = {bandwidth_term * 1e3:.1f} ms; fitted latency a = {a_fit * 1e3:.2f} ms per step, "
      f"{slope * 1e3:.2f} ms per bucket (the tiny tensors gave a = {latency * 1e3:.2f} ms)\n")
print(f"{'buckets':>8} {'bucket size':>12} {'measured (min-max)':>24} {'model':>10} {'measured/model':>15}")
for k, t, lo, hi in bucket_times:
    print(f"{k:>8} {MB // k // 1024:>8} KiB {t * 1e3:>8.1f} ms ({lo * 1e3:6.1f}-{hi * 1e3:6.1f}) "
          f"{model[k] * 1e3:>7.1f} ms {t / model[k]:>15.2f}")
if not on_nodes:
    saved("buckets")

# %% [markdown]
# Up to 16 buckets the latency is small next to the 90 ms of the bandwidth term and the times barely
# move; at 64 buckets (16 KiB each) it starts to show, and at 256 buckets (4 KiB each) it dominates:
# several times the bandwidth term for the same bytes. The fitted `a` is of the order of the one the
# tiny tensors gave, under a millisecond per step; both move with the machine's load from run to
# run, which is why the fit is made on the same rounds as the measurements it is compared with.
#
# With 1 and 4 buckets the link's bandwidth sets the time, and the fastest of the rounds is held to
# the model below: a round that other work on the machine slowed shows in the median and the spread.
#
# Middle-sized buckets sit under the straight line, and that is this link, not the model: its token
# bucket saves up credit while the sender pauses between two all-reduces and lets the next 32 KiB go
# at once, so a bucket of a few tens of KiB makes up much of its pause. A real wire loses the time it
# stands idle.

# %% tags=["nbval-check-output"]
print("256 buckets cost more than 2x one bucket:", measured[256] > 2 * measured[1])
print("64 buckets cost more than one bucket, and 256 more than 64:", measured[1] < measured[64] < measured[256])
if on_nodes:
    fastest = {k: lo for k, _, lo, _ in bucket_times}   # other work on the machine only ever slows a round
    print("1 and 4 buckets: the fastest round within 0.85x to 1.2x of the model:",
          all(0.85 < fastest[k] / model[k] < 1.2 for k in (1, 4)))
else:
    saved("buckets against the model")

# %% [markdown]
# ## What a bucket buys: overlap with backward
#
# Why not one giant bucket, then? Because DDP launches a bucket's all-reduce as soon as all its
# gradients are ready, while backward goes on computing the rest (buckets are filled in reverse order
# of the parameters, roughly the order backward produces them). With one bucket, nothing can start
# until backward is over, and the whole all-reduce is **exposed**: the step waits for all of it.
# With several, most of it can run during backward.
#
# Below, a model of 8 layers of 256 x 256 (526 K parameters, 2.1 MB of fp32 gradients) trains on a
# batch of 4,096 with four bucket caps, and once with no communication at all (`no_sync()`, for the
# compute alone). At 12.5 MB/s the 2.1 MB all-reduce takes about 0.18 s, a little longer than the
# backward pass (about 0.12 s here): the case where overlap matters most. The five models take one step each in turn,
# seven rounds (the first two left out while DDP settles its buckets), so that they share whatever
# load the machine has. In each step a hook on every parameter notes when backward has produced its
# last gradient: from there to the end of `loss.backward()` (which returns when every bucket is
# all-reduced) is the exposed communication. The model, `theory.overlapped_backward_time_s`,
# launches each bucket when backward has produced its share of the gradients and sends one bucket
# at a time over the link (`B` and `a` as measured above). The buckets' sizes come from DDP's own
# record, `model._get_ddp_logging_data()`: private (the underscore says so, and it may change between
# releases), it is the record DDP keeps for its own logging (torch's `DDPLoggingData`), read here
# after the timed steps at no cost to them. The public way,
# a hook registered with `model.register_comm_hook` that notes each `bucket.buffer()`'s size, would
# put Python on the path being timed.

# %%
# %%ddp
import contextlib
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

def layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())
                                 for _ in range(8)])

CAPS = ("no_sync", "100", "1", "0.5", "0.25")          # bucket_cap_mb; no_sync: compute alone
models = {cap: DDP(layers().to(device), bucket_cap_mb=100 if cap == "no_sync" else float(cap)) for cap in CAPS}
optims = {cap: torch.optim.SGD(m.parameters(), lr=0.01) for cap, m in models.items()}
last_grad = {}                                          # when backward produced each model's last gradient
for cap, m in models.items():
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p, cap=cap: last_grad.__setitem__(cap, time.perf_counter()))
x, target = torch.randn(4096, 256, device=device), torch.randn(4096, 256, device=device)
parts = {cap: [] for cap in CAPS}                       # (forward, backward compute, exposed comm, step)
for step in range(7):
    for cap in CAPS:
        model, opt = models[cap], optims[cap]
        dist.barrier()
        with model.no_sync() if cap == "no_sync" else contextlib.nullcontext():
            t0 = time.perf_counter()
            loss = F.mse_loss(model(x), target)
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss.backward()                             # returns when every bucket is all-reduced
            t2 = time.perf_counter()
            opt.step()
            parts[cap].append((t1 - t0, last_grad[cap] - t1, t2 - last_grad[cap], time.perf_counter() - t0))
medians = torch.tensor([[sorted(col)[2] for col in zip(*parts[cap][2:])] for cap in CAPS], device=device)
dist.all_reduce(medians, op=dist.ReduceOp.MAX)          # the slower rank's medians
overlap = {}
for cap, row in zip(CAPS, medians.tolist()):
    logged = models[cap]._get_ddp_logging_data()
    sizes = logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes")
    overlap[cap] = dict(zip(("forward_s", "backward_s", "exposed_s", "step_s"), row),
                        bucket_bytes=[int(b) for b in str(sizes).split(",")])

# %%
overlap = lab.pull("overlap")
CAPS = ("100", "1", "0.5", "0.25")
alone = overlap[0]["no_sync"]
fwd, bwd = alone["forward_s"], alone["backward_s"]
grad_bytes = sum(alone["bucket_bytes"])
a = a_fit                                              # the latency per step of the ring, fitted above
print(f"compute alone: forward {fwd * 1e3:.0f} ms, backward {bwd * 1e3:.0f} ms, step {alone['step_s'] * 1e3:.0f} ms; "
      f"all-reduce of the {grad_bytes / 1e6:.1f} MB alone, ring model: "
      f"{theory.ring_allreduce_time_s(grad_bytes, 2, B, a) * 1e3:.0f} ms\n")
rest = alone["step_s"] - fwd - bwd                     # zero_grad and the optimizer step
print(f"{'':>22} {'backward compute':>17} {'exposed comm':>20} {'step':>22}")
print(f"{'bucket_cap_mb':>13} {'buckets':>8} {'measured':>9} {'model':>7} {'measured':>10} {'model':>9} "
      f"{'measured':>10} {'model':>7} {'ratio':>5}")
model_exposed, model_step = {}, {}
for cap in CAPS:
    r = overlap[0][cap]
    model_exposed[cap] = theory.overlapped_backward_time_s(bwd, r["bucket_bytes"], 2, B, a) - bwd
    model_step[cap] = fwd + bwd + model_exposed[cap] + rest
    print(f"{cap:>13} {len(r['bucket_bytes']):>8} {r['backward_s'] * 1e3:>6.0f} ms {bwd * 1e3:>4.0f} ms "
          f"{r['exposed_s'] * 1e3:>7.0f} ms {model_exposed[cap] * 1e3:>6.0f} ms {r['step_s'] * 1e3:>7.0f} ms "
          f"{model_step[cap] * 1e3:>4.0f} ms {r['step_s'] / model_step[cap]:>5.2f}")

# %% [markdown]
# How to read it. With one bucket, the step waits for the whole all-reduce after backward, as the
# model says. With more buckets, the all-reduces start during backward, the exposed part shrinks,
# and, where the machine has cores to spare, the step with it.
#
# One thing the model leaves out, and this machine cannot hide: the model assumes that computing and
# communicating do not slow each other down, as on a GPU, where the all-reduce runs on its own stream
# and the network card moves the bytes. Here the two ranks' backward passes already fill the two
# cores, and the all-reduces need them too: gloo's threads and the kernel's network path copy every
# byte and wake up for every message. The "backward compute" column shows it: with 8 buckets in
# flight during backward, backward takes longer than with one bucket (whose all-reduce waits until
# backward is over): by 15% to 75% in our runs on a quiet machine. So with many buckets the measured
# step usually comes out longer than the model's, by up to a fifth (the ratio column), even where the
# exposed part matches the model's. On a machine busy with other work (other programs, a test run
# beside the notebook), that work takes the cores in turns with the ranks and swamps these effects:
# the step with 8 buckets was then no shorter than with one, backward no longer with 8 buckets in
# flight, and the exposed parts far from the model. So these timings are shown, in the table, and not
# checked below; the buckets themselves are. Li et al. (2020), "PyTorch Distributed: Experiences on
# Accelerating Data Parallel Training" (VLDB), describe DDP's bucketing and measure its overlap on GPUs.

# %% tags=["nbval-check-output"]
for cap in CAPS:
    r = overlap[0][cap]
    print(f"bucket_cap_mb={cap}: {len(r['bucket_bytes'])} buckets on rank 0, "
          f"{len(overlap[1][cap]['bucket_bytes'])} on rank 1, holding {sum(r['bucket_bytes']):,} bytes")

# %% [markdown]
# The ratio of compute to exposed communication is what sets scaling efficiency
# (`theory.expected_scaling_efficiency`: compute / (compute + exposed communication)):

# %%
compute_s = alone["step_s"]
for cap in ("100", "0.25"):
    exposed = overlap[0][cap]["exposed_s"]
    print(f"bucket_cap_mb={cap:>4}: compute {compute_s * 1e3:.0f} ms, exposed communication {exposed * 1e3:.0f} ms, "
          f"ratio {theory.compute_comm_ratio(compute_s, exposed):.1f}, "
          f"expected efficiency {theory.expected_scaling_efficiency(compute_s, exposed):.0%}")

# %% [markdown]
# The live view: `distlab.watch` times every bucket's all-reduce as DDP launches it. Three more
# steps of the 8-bucket model, watched; the dashboard under the cell shows the all-reduces of each
# step, bucket by bucket, starting during backward:

# %%
# %%ddp
model, opt = models["0.25"], optims["0.25"]
with distlab.watch(model):
    for step in range(3):
        loss = F.mse_loss(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        distlab.log(loss=loss)

# %% [markdown]
# These watched steps take longer than the same model's steps in the table above (its `0.25` row):
# only three of them, and each bucket is timed on the rank as DDP launches it (through a stand-in
# for DDP's process group), which puts a little Python on the path of every all-reduce; the first
# step also takes the weights' norms and checksum (every 50 steps by default). On DDP the watch cost 11% of the steps per
# second in `benchmarks/RESULTS.md` ("What watching costs on FSDP2 and tensor-parallel models"), and
# on this loaded link and machine the difference from run to run is larger still. Read the watched
# run for its shape (when each bucket starts, which rank waited), the table for the times.
#
# ## What a bucket costs: memory
#
# A bucket is a flat buffer that the gradients are copied into before the all-reduce. Together the
# buckets hold **every** gradient once, whatever `bucket_cap_mb` (the cap sets how many buckets
# there are, not how much they hold: the table above shows 2,105,344 bytes for every cap). So by
# default DDP keeps the gradients twice: in each parameter's `.grad` and in the buckets.
# `gradient_as_bucket_view=True` removes the second copy: the `.grad` tensors become views into the
# buckets (PyTorch's `DistributedDataParallel` documentation: "the saved memory size will be equal
# to the total gradients size"). Counted below from the storages themselves: every distinct block of
# memory that a `.grad` or a bucket lives in, read in a communication hook that sees each bucket.

# %%
# %%ddp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

def gradient_memory(cap, view):
    """Bytes of the distinct storages behind the .grad tensors and DDP's buckets."""
    model = DDP(layers().to(device), bucket_cap_mb=cap, gradient_as_bucket_view=view)
    buckets = {}

    def spy(state, bucket):
        storage = bucket.buffer().untyped_storage()
        buckets[bucket.index()] = (storage.data_ptr(), storage.nbytes())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, spy)
    x = torch.randn(64, 256, device=device)
    for _ in range(2):                                 # the second step runs on the rebuilt buckets
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()}
    return {"grads": sum(grads.values()), "buckets": sum(n for _, n in buckets.values()),
            "distinct": sum({**grads, **dict(buckets.values())}.values()),
            "grads_in_buckets": all(ptr in dict(buckets.values()) for ptr in grads)}

memory = {(cap, view): gradient_memory(cap, view) for cap in (0.25, 100) for view in (False, True)}

# %%
memory = lab.pull("memory", ranks=0)[0]
print(f"{'bucket_cap_mb':>13} {'gradient_as_bucket_view':>24} {'.grad storage':>14} {'buckets':>10} {'in all':>10}")
for (cap, view), m in memory.items():
    print(f"{cap:>13} {view!s:>24} {m['grads'] / 1e6:>11.2f} MB {m['buckets'] / 1e6:>7.2f} MB {m['distinct'] / 1e6:>7.2f} MB")

# %% tags=["nbval-check-output"]
print("the buckets hold all the gradients, whatever the cap:", all(m["buckets"] == grad_bytes for m in memory.values()))
print("by default, gradients are kept twice (.grad and buckets):",
      all(m["distinct"] == 2 * grad_bytes for (cap, view), m in memory.items() if not view))
print("gradient_as_bucket_view=True: .grad are views into the buckets, one copy:",
      all(m["grads_in_buckets"] and m["distinct"] == grad_bytes for (cap, view), m in memory.items() if view))

# %% [markdown]
# So in DDP the trade-off of the bucket size is time, not memory: smaller buckets start the
# all-reduce sooner (more overlap) but pay the latency more often. PyTorch's default is 25 MB, with a
# first bucket of 1 MB so that communication starts early; `bucket_cap_mb` is worth tuning when a
# profile shows exposed communication. "Larger buckets cost memory" is true of libraries that stage
# the gradients through a buffer one bucket at a time instead of keeping every bucket: DeepSpeed's
# ZeRO, for one, whose `reduce_bucket_size` is the "number of elements reduced/allreduced at a time"
# and "limits the memory required" (DeepSpeed's configuration documentation).
#
# The live view again, as `lab.dashboard()` (the watched run: 8 buckets per step):

# %%
lab.dashboard()

# %% [markdown]
# ## Practice

# %%
# %quiz communication-cost -n 4

# %% [markdown]
# ## Build it yourself
#
# The exercises for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise ring-allreduce`: `ring_all_reduce(tensor)` from `send` and `recv` only, its bytes counted against the ring model and its time against `dist.all_reduce`.
# * `%exercise ddp-from-hooks`: DDP from autograd hooks: buckets whose all-reduces start during backward, the overlap measured.

# %%
# %dist stop
