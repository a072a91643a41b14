# %% [markdown]
# # 08 · Cutting communication: gradient compression hooks
#
# DDP all-reduces every gradient, in fp32, every step. When that all-reduce is the slow part of the
# step, sending **fewer bytes** helps. DDP lets you replace its all-reduce with a **communication hook**,
# and PyTorch ships two kinds:
#
# * `fp16_compress_hook`: cast each bucket to fp16, all-reduce, cast back. Half the bytes, a small loss
#   of precision;
# * **PowerSGD** (`powerSGD_hook`): approximate each gradient matrix `G` (n x m) by a low-rank product
#   `P Q^T` with rank r, and all-reduce `P` (n x r) and `Q` (m x r) instead of `G`. For a 1024 x 1024
#   layer and r = 1 that is 2,048 numbers instead of 1,048,576. What the approximation misses is kept
#   and added to the next step's gradient (**error feedback**), so it is delayed, not lost.
#
# Compression is not free: it costs computation on both ends, and it changes the gradient. It pays
# only when communication dominates the step. This lab measures both cases.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## The bytes each hook sends
#
# The model: four 1024 x 1024 linear layers, 4.2 M parameters, 16.8 MB of fp32 gradients. What one
# rank puts into the all-reduce per step with each hook (PowerSGD leaves vectors, the biases,
# uncompressed):

# %% tags=["nbval-check-output"]
import torch
import distlab
from distlab import theory

lab = distlab.current_lab()
shapes = [(1024, 1024), (1024,)] * 4
params = sum(torch.Size(s).numel() for s in shapes)
sent = {
    "allreduce (fp32)": 4 * params,
    "fp16_compress_hook": 2 * params,
    "powerSGD rank 1": sum(4 * (s[0] + s[1]) * 1 if len(s) == 2 else 4 * s[0] for s in shapes),
    "powerSGD rank 4": sum(4 * (s[0] + s[1]) * 4 if len(s) == 2 else 4 * s[0] for s in shapes),
}
for name, b in sent.items():
    print(f"{name:>20}: {b / 1e6:7.3f} MB per step, {4 * params / b:6.1f}x less than fp32")

# %% [markdown]
# ## Measured: a step that is mostly communication, and one that is mostly compute
#
# Each configuration trains for 10 steps; the first steps are left out (DDP settles its buckets, and
# PowerSGD starts compressing at step 2). A **batch of 8** makes the step communication-bound: the
# matrix multiplies are tiny, the 16.8 MB all-reduce is not. A **batch of 512** makes it compute-bound.
# The time kept is the slower rank's median.
#
# All four runs put the gradients in one bucket (`bucket_cap_mb=100`): with several buckets in
# flight, PowerSGD's chain of all-reduces (uncompressed vectors, then P, then Q, bucket by bucket)
# reaches gloo in a different order on each rank and the job aborts with a size mismatch. On NCCL,
# which runs collectives in the order they are issued on one stream, this does not happen.

# %%
# %%ddp
import time
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])

def with_hook(name):
    # One bucket for the whole model: with several buckets in flight, PowerSGD's chained
    # all-reduces reach gloo in different orders on the two ranks and abort (torch 2.13).
    model = DDP(make(), bucket_cap_mb=100)
    if name == "fp16_compress_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name.startswith("powerSGD"):
        state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2,
                                            matrix_approximation_rank=int(name.split()[-1]))
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return model

def run(name, batch, steps=10):
    model = with_hook(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    times, losses = [], []
    for step in range(steps):
        x, target = torch.randn(batch, 1024, generator=gen), torch.randn(batch, 1024, generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    t = torch.tensor(sorted(times[3:])[len(times[3:]) // 2])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    weights = [p.detach().clone() for p in model.module.parameters()]
    return t.item(), weights

HOOKS = ["allreduce (fp32)", "fp16_compress_hook", "powerSGD rank 1", "powerSGD rank 4"]
step_time, weights = {}, {}
for batch in (8, 512):
    for name in HOOKS:
        step_time[(name, batch)], weights[(name, batch)] = run(name, batch)

# %%
step_time, weights = lab.pull("step_time", ranks=0)[0], lab.pull("weights")
HOOKS = ["allreduce (fp32)", "fp16_compress_hook", "powerSGD rank 1", "powerSGD rank 4"]
print(f"{'hook':>20} {'batch 8':>10} {'batch 512':>11}   (median step, slower rank)")
for name in HOOKS:
    print(f"{name:>20} {step_time[(name, 8)] * 1e3:>8.1f}ms {step_time[(name, 512)] * 1e3:>9.1f}ms")
for batch in (8, 512):
    base = step_time[("allreduce (fp32)", batch)]
    gains = ", ".join(f"{n}: {base / step_time[(n, batch)]:.2f}x" for n in HOOKS[1:])
    print(f"batch {batch}: speed-up over fp32 all-reduce: {gains}")

# %% [markdown]
# How to read it. Compression trades bytes for computation: casting to fp16 and back, or PowerSGD's
# extra matrix products and orthogonalisation, on both ranks, every step. It pays when the bytes saved
# take longer to send than the extra computation takes to run. Here the "network" is loopback TCP
# between two processes on one machine, and the computation is done by the same two CPU cores that
# also run the training: sending 16.8 MB costs about as much as compressing it, so on this machine the
# hooks often do **not** pay, and which one wins changes from run to run. The fastest of this run:

# %%
for batch in (8, 512):
    best = min(HOOKS, key=lambda n: step_time[(n, batch)])
    print(f"batch {batch}: fastest was {best}")


# %% [markdown]
# On a real cluster the balance moves: a GPU compresses at hundreds of GB/s, while the link between
# nodes carries 1 to 25 GB/s. Rules of thumb:
#
# * compression helps when the compute/communication ratio is low: big models on slow links
#   (Ethernet between nodes), small per-device batches, many workers;
# * it does not help when the step is compute-bound, on fast links (NVLink, InfiniBand, loopback),
#   when compressing costs as much as sending, or when the gradients are small enough that latency,
#   not bandwidth, dominates (notebook 03);
# * it changes the optimisation: fp16 rounds (and can underflow tiny gradients), PowerSGD approximates.
#   Check that the model still reaches the same quality.
#
# Whatever the hook, the replicas must stay identical: every rank decompresses the same all-reduced
# data. And the further the compression, the further the weights move from the uncompressed run's:

# %%
def distance(a, b):
    return (sum((x - y).pow(2).sum() for x, y in zip(a, b)) ** 0.5).item()

for batch in (8, 512):
    ref = weights[0][("allreduce (fp32)", batch)]
    print(f"batch {batch}: distance of the weights from the fp32 run after 10 steps: " + ", ".join(
        f"{n} {distance(weights[0][(n, batch)], ref):.2e}" for n in HOOKS[1:]))

# %% tags=["nbval-check-output"]
identical = all(torch.equal(a, b) for key in weights[0] for a, b in zip(weights[0][key], weights[1][key]))
print("replicas identical under every hook:", identical)
order = [distance(weights[0][(n, 8)], weights[0][("allreduce (fp32)", 8)]) for n in HOOKS[1:3]]
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
