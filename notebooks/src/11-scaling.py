# %% [markdown]
# # 11 · Scaling: what a second rank buys, and what N ranks would
#
# Why distribute at all? Because a model's parameters and training state can outgrow one device's
# memory (tens of GB per GPU), because a data set of millions or billions of examples takes too long
# to go through on one device, because faster iterations mean more experiments, and because many
# cheaper devices can beat one expensive one. And when not to: a small model on a small data set
# spends more time talking than computing, and a single device is faster.
#
# Training time grows **linearly with the number of batches**. Adding workers divides the
# computation, but not the communication and the waiting: the speed-up is less than the number of
# workers. This lab measures it, going from 1 to 2 ranks, and then uses the cost model to predict N.
#
# Two measures:
#
# * **speed-up** S(N) = T(1) / T(N): how many times faster N workers finish the same job;
# * **efficiency** E(N) = S(N) / N: 1.0 is perfect scaling.

# %% [markdown]
# ## The job
#
# The same job runs on 1 rank and then on 2: a fixed number of steps, each on a **global batch of 512**
# digits, with an MLP of 1.1 M parameters. On 2 ranks each takes half of every batch (this is
# *strong scaling*: the total work stays fixed). Each rank uses one CPU thread, as if each had one
# device of its own.
#
# The training function is defined in the notebook and pushed to whichever world is running.

# %%
import torch
import distlab
from distlab import theory
from sklearn.datasets import load_digits

digits = load_digits()
GLOBAL_BATCH = 512

def train(steps):
    """`steps` steps on the global batch split over the ranks; returns (seconds, weights)."""
    import time
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)                       # one "device" per rank
    rank, world = dist.get_rank(), dist.get_world_size()
    X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    Y = torch.tensor(digits.target)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    order = torch.randperm(len(Y), generator=torch.Generator().manual_seed(1))
    w = distlab.watch(model)
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(steps):
        rows = order[torch.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH) % len(Y)]
        rows = rows[rank::world]                   # this rank's share of the global batch
        loss = F.cross_entropy(model(X[rows]), Y[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        distlab.log(loss=loss)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    w.close()
    return elapsed, [p.detach().clone() for p in net.parameters()]


# %% [markdown]
# ## One rank
#
# `%dist restart` keeps the world size, so changing it means stopping and starting again.

# %%
# %load_ext distlab
# %dist start -n 1

# %%
lab = distlab.current_lab()
lab.push(train=train, digits=digits, GLOBAL_BATCH=GLOBAL_BATCH)
lab.run("train(2)", stream=False)                  # warm-up: first steps pay one-off costs
t1, w1 = lab.run("train(20)", stream=False)[0]
t1_short = lab.run("train(10)", stream=False)[0][0]
print(f"1 rank: 20 steps in {t1:.2f} s, 10 steps in {t1_short:.2f} s")

# %%
# %dist stop

# %% [markdown]
# ## Two ranks

# %%
# %dist start -n 2

# %%
lab = distlab.current_lab()
lab.push(train=train, digits=digits, GLOBAL_BATCH=GLOBAL_BATCH)
lab.run("train(2)", stream=False)
result = lab.run("train(20)")
t2, w2 = result[0]
t2_short = lab.run("train(10)", stream=False)[0][0]
print(f"2 ranks: 20 steps in {t2:.2f} s, 10 steps in {t2_short:.2f} s")
print(f"speed-up {theory.speedup(t1, t2):.2f}, efficiency {theory.parallel_efficiency(t1, t2, 2):.0%}")

# %% [markdown]
# The dashboard shows the latest watched run (the 10 steps on 2 ranks). Look at the share of each
# step spent in the all-reduce, and at which rank the other waited for:

# %%
lab.dashboard()

# %% [markdown]
# The speed-up is below 2 for the reasons the curriculum names: the all-reduce of 4.5 MB of gradients
# every step, the ranks waiting for each other at every step, and, on this machine, two processes
# sharing two cores with everything else that runs here. Still, the job is the same job: with the same
# global batch, the two ranks end with the model one rank trained (up to float rounding, since the
# sum is taken in a different order):

# %% tags=["nbval-check-output"]
print("2 ranks trained the same model as 1 rank:",
      all(torch.allclose(a, b, atol=1e-5) for a, b in zip(w1, w2)))
print("twice the steps take longer, on 1 rank and on 2:", t1 > t1_short and t2 > t2_short)

# %% [markdown]
# ## From 2 to N, with the cost model
#
# What would 4, 8 or 64 ranks do? Split the step into its parts and scale each:
#
# * compute per rank shrinks as 1/N (each rank gets 1/N of the global batch);
# * the ring all-reduce of the S bytes of gradients costs `2(N-1)/N * S/B + (N-1)a`, which *grows*
#   towards `2S/B` as N grows.
#
# Measure the link (latency `a`, bandwidth `B`) with a quick all-reduce sweep, and take the compute
# time per step from the 1-rank run:

# %%
# %%ddp
import time
sweep = []
for size in (4096, 65536, 1 << 20, 4 << 20):
    buf = torch.ones(size // 4)
    runs = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        runs.append(time.perf_counter() - t0)
    sweep.append((size, sorted(runs)[2]))

# %%
link = theory.fit_latency_bandwidth(lab.pull("sweep", ranks=0)[0], workers=2)
grad_bytes = sum(p.numel() for p in w1) * 4
compute_1 = t1 / 20                                   # seconds per step on one rank
print(f"link: a = {link.latency_s * 1e6:.0f} us, B = {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s; "
      f"gradients {grad_bytes / 1e6:.1f} MB; compute {compute_1 * 1e3:.0f} ms per step on 1 rank\n")
print(f"{'N':>4} {'compute':>9} {'all-reduce':>11} {'step':>9} {'speed-up':>9} {'efficiency':>11}")
for n in (1, 2, 4, 8, 16, 64):
    compute = compute_1 / n
    comm = link.allreduce_time_s(grad_bytes, n)
    step = compute + comm                              # no overlap: a pessimistic model
    print(f"{n:>4} {compute * 1e3:>7.1f}ms {comm * 1e3:>9.1f}ms {step * 1e3:>7.1f}ms "
          f"{theory.speedup(compute_1, step):>9.2f} {theory.parallel_efficiency(compute_1, step, n):>11.0%}")

# %% [markdown]
# The speed-up flattens: past some N, adding ranks shrinks the part that was already small and leaves
# the all-reduce, which does not shrink. Three levers move that point:
#
# * **overlap** communication with the backward pass (DDP's buckets; this model has none in the table);
# * **a larger global batch** (weak scaling: keep the per-rank batch, so compute per rank stays constant;
#   then efficiency is compute / (compute + communication), whatever N is);
# * **less to send** (compression, notebook 08) or **faster links**.
#
# Amdahl's law puts a ceiling on it: if a fraction of the work does not spread, the speed-up can never
# exceed 1 / (that fraction). Some worked numbers:

# %% tags=["nbval-check-output"]
print("4 workers, 120 s -> 40 s: speed-up", theory.speedup(120, 40),
      "| efficiency", theory.parallel_efficiency(120, 40, 4))
print("95% parallel work on 8 workers: at most", round(theory.amdahl_speedup(0.95, 8), 2), "x")
print("1000 batches at 0.25 s each:", theory.training_time_s(1000, 0.25), "seconds")
print("compute 30 ms, all-reduce 10 ms, half of it hidden: efficiency",
      round(theory.expected_scaling_efficiency(0.030, 0.010, overlap_fraction=0.5), 3))

# %% [markdown]
# How to measure scaling on a real cluster: fix the job, time it on 1, 2, 4, ... workers (after a
# warm-up, over enough steps to average out noise), compute speed-up and efficiency, and compare
# with what the compute/communication ratio predicts. A large gap between prediction and measurement
# points to stragglers, data loading, or a network slower than you think.
#
# ## Practice

# %%
# %quiz scaling -n 3

# %%
# %quiz why-distribute -n 3

# %%
# %dist stop
