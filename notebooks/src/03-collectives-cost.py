# %% [markdown]
# # 03 · Collectives and what they cost
#
# Every data-parallel step ends in an all-reduce of the gradients, so its cost is paid on every
# step. This lab measures it on your two ranks, fits the standard cost model to the measurements,
# and then looks at how DDP packs gradients into **buckets** and why the bucket size matters.
#
# The model for a ring all-reduce of `S` bytes over `N` workers, on links of bandwidth `B` with a
# per-message latency `a`:
#
# $$T \approx \frac{2(N-1)}{N}\cdot\frac{S}{B} + (N-1)\,a$$
#
# In the ring, each worker sends (and receives) `2(N-1)/N` of the buffer: half of that in a
# reduce-scatter (each worker ends up owning the sum of one slice), half in an all-gather (the
# slices are passed round). Small messages are dominated by the latency term, large ones by the
# bandwidth term.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## Measuring all-reduce over sizes
#
# Each rank all-reduces buffers from 4 KB to 16 MB, a few times each after a warm-up. A collective
# ends at about the same moment everywhere, but a rank can *start* early and wait for the other,
# so each repetition begins with a barrier, and the time kept is the slower rank's (`MAX`).

# %%
# %%ddp
import time
sizes = [4 * 4**k * 1024 for k in range(7)]          # bytes: 4 KB, 16 KB, ..., 16 MB
timings = []                                           # (size_bytes, median seconds)
for size in sizes:
    buf = torch.ones(size // 4)                        # float32: 4 bytes each
    repeats = 20 if size < 1 << 20 else 6
    runs = []
    for i in range(repeats + 2):                       # the first two are warm-up
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        runs.append(time.perf_counter() - t0)
    t = torch.tensor(sorted(runs[2:])[len(runs[2:]) // 2])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)           # the slower rank's median
    timings.append((size, t.item()))

# %%
import distlab
from distlab import theory

lab = distlab.current_lab()
timings = lab.pull("timings", ranks=0)[0]
fit = theory.fit_latency_bandwidth(timings, workers=2)
print(f"fitted: latency a = {fit.latency_s * 1e6:.0f} us, bandwidth B = {fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s\n")
print(f"{'size':>8} {'measured':>10} {'ring model':>11} {'algbw':>10} {'busbw':>10}")
for size, t in timings:
    print(f"{size / 1024:>6.0f}KB {t * 1e3:>8.2f}ms {fit.allreduce_time_s(size, 2) * 1e3:>9.2f}ms "
          f"{theory.algbw_bytes_per_s(size, t) / 1e9:>6.2f}GB/s {theory.busbw_bytes_per_s(size, t, 2) / 1e9:>6.2f}GB/s")

# %% [markdown]
# Two bandwidths are in the table. **algbw** is the buffer size over the time: what the
# application sees. **busbw** = algbw x 2(N-1)/N corrects for the share of the buffer each worker
# really sends, so it can be compared with the link's speed whatever the number of workers (with
# N = 2 the factor is 1, and the two are equal). At the small end, the time hardly changes with the
# size: that is the latency floor. At the large end, time grows in proportion to size: bandwidth.
#
# These are two processes on one machine talking through loopback TCP, so the "link" is memory
# copies and the kernel's network stack; the same method on real GPUs with NCCL gives microseconds
# and tens to hundreds of GB/s. A few sanity checks that hold on any machine:

# %% tags=["nbval-check-output"]
small, large = timings[0][1], timings[-1][1]
print("a 16 MB all-reduce takes longer than a 4 KB one:", large > small)
print("4096x the bytes costs far less than 4096x the time:", large < 4096 * small)
print("the fitted model has a positive bandwidth:", fit.bandwidth_bytes_per_s > 0)

# %% [markdown]
# The model in numbers for a bigger machine, from `distlab.theory`: 4 workers, a 400 MB gradient,
# 25 GB/s links, 5 us latency. The bandwidth term is 1.5 x 16 ms = 24 ms, the latency term 15 us:

# %% tags=["nbval-check-output"]
t = theory.ring_allreduce_time_s(400e6, workers=4, bandwidth_bytes_per_s=25e9, latency_s=5e-6)
print("ring all-reduce, milliseconds:", round(t * 1e3, 3))
print("bytes each worker sends, MB:", theory.ring_allreduce_sent_bytes(400e6, 4) / 1e6)

# %% [markdown]
# ## Many tiny tensors: the latency trap
#
# Reducing 256 small tensors one at a time pays the latency 256 times; flattening them into one
# buffer pays it once. Same bytes, very different time:

# %%
# %%ddp
tensors = [torch.ones(256) for _ in range(256)]      # 256 x 1 KB
dist.barrier()
t0 = time.perf_counter()
for t in tensors:
    dist.all_reduce(t)
one_by_one = time.perf_counter() - t0
flat = torch.cat(tensors)
dist.barrier()
t0 = time.perf_counter()
dist.all_reduce(flat)
at_once = time.perf_counter() - t0
if rank == 0:
    print(f"256 all-reduces of 1 KB: {one_by_one * 1e3:.1f} ms; one of 256 KB: {at_once * 1e3:.2f} ms")

# %%
one_by_one, at_once = lab.pull("one_by_one", ranks=0)[0], lab.pull("at_once", ranks=0)[0]
predicted_many = theory.bucketed_allreduce_time_s(256 * 1024, 1024, 2, fit.bandwidth_bytes_per_s, fit.latency_s)
predicted_one = theory.bucketed_allreduce_time_s(256 * 1024, 256 * 1024, 2, fit.bandwidth_bytes_per_s, fit.latency_s)
print(f"model: {predicted_many * 1e3:.1f} ms vs {predicted_one * 1e3:.2f} ms")
print(f"flattening made it {one_by_one / at_once:.0f}x faster")

# %% tags=["nbval-check-output"]
print("one flat all-reduce beats 256 small ones:", at_once < one_by_one)

# %% [markdown]
# ## DDP buckets
#
# DDP does the flattening for you. It groups gradients into **buckets** of about `bucket_cap_mb`
# megabytes (in reverse order of the parameters, roughly the order backward produces them) and
# launches a bucket's all-reduce as soon as all its gradients are ready, while backward goes on
# computing the rest. Bigger buckets mean fewer latency payments but a later start (less overlap)
# and an extra flat copy of the gradients in memory; tiny buckets are the latency trap again.
#
# Below, one model of 4.2 M parameters (16.8 MB of fp32 gradients) is trained for a few steps with
# four bucket caps. `distlab.watch` times every bucket's all-reduce as DDP launches it; the
# dashboard under the cell follows the runs live (it shows the latest watch: the all-reduce
# timeline of its last steps, bucket by bucket).

# %%
# %%ddp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

def layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU())
                                 for _ in range(4)])

x, target = torch.randn(32, 1024), torch.randn(32, 1024)
bucket_runs = {}
for cap_mb in (0.25, 1, 5, 25):
    model = DDP(layers(), bucket_cap_mb=cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with distlab.watch(model) as w:
        for step in range(8):
            loss = F.mse_loss(model(x), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            distlab.log(loss=loss)
    recs = w.records()[2:]                 # after DDP has settled its buckets
    bucket_runs[cap_mb] = {
        "buckets": len(recs[-1]["allreduce"]),
        "step_s": sorted(r["step_time_s"] for r in recs)[len(recs) // 2],
        "comm_s": sorted(r["comm_s"] for r in recs)[len(recs) // 2],
    }

# %%
runs = lab.pull("bucket_runs")
print(f"{'bucket_cap_mb':>13} {'buckets':>8} {'step (rank 0)':>14} {'exposed comm':>13}")
for cap, r in runs[0].items():
    print(f"{cap:>13} {r['buckets']:>8} {r['step_s'] * 1e3:>12.1f}ms {r['comm_s'] * 1e3:>11.1f}ms")

# %% [markdown]
# The number of buckets follows from the cap and the layer sizes (a 1024 x 1024 weight is 4 MB),
# and both ranks must agree on it, or their all-reduces would not match up:

# %% tags=["nbval-check-output"]
for cap in runs[0]:
    print(f"bucket_cap_mb={cap}: {runs[0][cap]['buckets']} buckets on rank 0, "
          f"{runs[1][cap]['buckets']} on rank 1")

# %% [markdown]
# What to read in the step times: with a handful of buckets, the all-reduce of the last layers'
# gradients runs while backward computes the first layers', so part of the communication is hidden
# ("exposed comm" is what is left after backward ends). With one huge bucket nothing can start
# until backward is over. On two CPU processes sharing two cores, compute and communication also
# compete for the same cores, so the differences are small and noisy; on GPUs, where the all-reduce
# runs on its own stream, overlap is what makes DDP scale.
#
# The ratio of compute to communication is what sets scaling efficiency. From the 5 MB run:

# %%
r = runs[0][5]
compute_s = r["step_s"] - r["comm_s"]
print(f"compute {compute_s * 1e3:.1f} ms, exposed communication {r['comm_s'] * 1e3:.1f} ms, "
      f"ratio {theory.compute_comm_ratio(compute_s, r['comm_s']):.1f}")
print(f"expected efficiency at this ratio: {theory.expected_scaling_efficiency(compute_s, r['comm_s']):.0%}")

# %% [markdown]
# The live view again, as `lab.dashboard()` (the last run: one bucket of 16.8 MB per step):

# %%
lab.dashboard()

# %% [markdown]
# ## Practice

# %%
# %quiz communication-cost -n 4

# %%
# %dist stop
