# %% [markdown]
# # 10 · Pitfalls: deadlocks, divergence, and the process group
#
# Distributed bugs rarely crash. They **hang** (a collective waits for a rank that will never come)
# or they **drift** (the replicas quietly stop being replicas, in their weights or in buffers such as
# BatchNorm's running statistics, which DDP does not average). This lab causes each on purpose, on
# two ranks, and shows how to see it. Then it goes back to the start: what `init_process_group`
# needs, and what goes wrong when it is called wrong.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## The rank table and the environment
#
# distlab starts the ranks the way `torchrun` does: each process gets `RANK`, `WORLD_SIZE`,
# `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` (a free port the OS picked; never a fixed 29500, so
# two jobs on one machine do not collide). `init_process_group` has already run. Every printed line is
# tagged with its rank: with N ranks, untagged prints are unreadable.

# %%
# %%ddp
import os
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
print(env, "| backend:", dist.get_backend(), "| get_rank():", dist.get_rank())

# %% [markdown]
# ## A deadlock: a collective behind a rank-conditional
#
# A common way to hang a job: some work only rank 0 should do (logging, evaluation, saving) and a
# collective hidden inside it, here an all-reduce. Rank 1 skips the `if`, finishes the cell, and is
# never there to meet rank 0. Rank 0 waits.
#
# `%%ddp --timeout 5` gives the cell 5 seconds. distlab then stops the stuck rank, says **which rank
# was stuck on which line**, and rebuilds the process group so the next cell works. (A bare
# `torchrun` job would sit there until the process group's own timeout, 10 minutes on NCCL and 30 on
# gloo by default. On NCCL, the watchdog then reports the collective that timed out, with its
# sequence number, on each rank, and the flight recorder (`TORCH_NCCL_TRACE_BUFFER_SIZE` and
# `TORCH_NCCL_DUMP_ON_TIMEOUT=1`) dumps every rank's recent collectives, from which its analyser,
# `torchfrtrace`, names the ranks that never joined: PyTorch's flight recorder tutorial. Neither
# names the line of Python a rank was stuck on.)

# %% tags=["raises-exception"]
# %%ddp --timeout 5
t = torch.ones(1, device=device)
if rank == 0:
    dist.all_reduce(t)            # only rank 0 gets here: it waits for rank 1 forever
print("finished the cell")

# %% tags=["nbval-check-output"]
import distlab
lab = distlab.current_lab()
print("after the timeout:", lab.run("t = torch.ones(1, device=device); dist.all_reduce(t); t.item()", stream=False))

# %% [markdown]
# The fix is to make every rank reach every collective, in the same order, and keep the
# rank-specific part *outside* it:
#
# ```python
# dist.all_reduce(t)                # everybody
# if rank == 0:
#     print(t)                      # only the printing is rank-specific
# ```
#
# The same hang comes from collectives in **different orders** (rank 0 all-reduces then broadcasts,
# rank 1 the other way round), from a rank that leaves a loop one iteration early (uneven data:
# use `drop_last` or DDP's `join()`), and from a rank that raised an exception while the others went on
# to the next collective (distlab stops the others at once when a rank fails). Tools that name the
# culprit: `dist.monitored_barrier(timeout=...)` on gloo names the rank that did not arrive, and
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` checks every collective's op and shape across ranks.
#
# ## Divergence: replicas that stop being replicas
#
# Data parallelism is only correct if every replica holds the same weights after every step.
# `distlab.watch` computes an exact checksum of the weights on each rank (here at every step) and
# the dashboard compares them. Three runs of the same small model on each rank's own digits:

# %%
# %%ddp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from sklearn.datasets import load_digits

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32, device=device) / 16.0
Y = torch.tensor(digits.target, device=device)
mine = torch.arange(rank, len(Y), world_size, device=device)

def run(seed, average, use_ddp=False, steps=10):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).to(device)
    model = DDP(net) if use_ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with distlab.watch(model, checksum_every=1):
        for step in range(steps):
            rows = mine[step * 32:(step + 1) * 32]
            loss = F.cross_entropy(model(X[rows]), Y[rows])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if average:
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
            opt.step()
            distlab.log(loss=loss)


# %% [markdown]
# **1. Gradients not averaged.** Same seed, so the replicas start equal, but each rank steps with its
# own gradient. After the first step they differ, and the gap only grows:

# %%
# %%ddp
run(seed=0, average=False)

# %%
from distlab.dashboard import analysis

def verdict():
    return analysis.divergence(lab.telemetry.records(), lab.telemetry.meta())

def facts(d):
    return (f"diverged: {d.diverged} | ranks that differ: {d.ranks} | first step: {d.first_step} | "
            f"started apart: {d.started_apart} | steps compared: {d.checked_steps}")

print(verdict().message)

# %% [markdown]
# The same verdict as plain facts (this line is what the tests check):

# %% tags=["nbval-check-output"]
print(facts(verdict()))

# %% [markdown]
# **2. Different seeds.** Gradients are averaged, but each rank built its model with a different
# seed, so they were never replicas. Averaging keeps the *difference* constant; it never removes it:

# %%
# %%ddp
run(seed=rank, average=True)

# %%
print(verdict().message)

# %% tags=["nbval-check-output"]
print(facts(verdict()))

# %% [markdown]
# **3. Different seeds, but DDP.** When `DistributedDataParallel` wraps a model it broadcasts rank 0's
# weights to every rank, so a seed mismatch is repaired before the first step:

# %%
# %%ddp
run(seed=rank, average=False, use_ddp=True)

# %%
print(verdict().message)

# %% tags=["nbval-check-output"]
print(facts(verdict()))

# %% [markdown]
# The dashboard's divergence plot shows the same three stories as curves (the spread of the weights
# across ranks per step); its status line is the verdict above.
#
# Two more ways for the weights to drift: an update done on some ranks only (`if rank == 0:
# opt.step()`, or a learning-rate scheduler stepped on one rank), and parameters edited by hand on
# one rank. Non-deterministic GPU kernels are *not* one: they can make a rank's gradient differ from
# one run to the next, but DDP all-reduces the gradients and every rank applies the same average, so
# the replicas stay equal to each other (the run is merely not reproducible).
#
# ## Buffers: what DDP does not average
#
# DDP keeps the *parameters* equal by averaging their gradients. A model can also hold **buffers**:
# tensors it updates itself, without gradients. The everyday ones are BatchNorm's `running_mean`
# and `running_var`: in training mode every forward moves them toward the mean and variance of the
# batch it sees, **this rank's** batch, and in evaluation mode the layer normalises with them.
#
# DDP's answer is its `broadcast_buffers` flag, on by default ("syncing (broadcasting) buffers of
# the module at beginning of the `forward` function", `torch.nn.parallel.DistributedDataParallel`'s
# docs): when a forward through the DDP wrapper starts, rank 0's buffers are copied to every rank.
# Train the same small model with a BatchNorm layer both ways, under `distlab.watch`, then compare
# the buffers and the outputs in evaluation mode on one probe batch, the same 64 samples on every
# rank. (torch 2.13 renames the flag `forward_sync_buffers` and warns at the old name, which every
# torch release distlab runs on still takes; the cell silences that warning.) First, a prediction:

# %%
from distlab.quiz import predict

bn_guess = predict(
    "With broadcast_buffers=False, each rank trains 10 steps on its own batches. Then both evaluate the "
    "same 64 samples. What do you expect?",
    choices={"same": "weights, running statistics and outputs all equal on both ranks",
             "stats": "weights equal; running statistics differ, outputs equal",
             "both": "weights equal; running statistics differ, and so do the outputs",
             "weights": "the weights differ too"},
    answer="both",
)
bn_guess

# %%
# %%ddp
import warnings
warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)

probe = X[:64]                                       # the same 64 samples on every rank

def bn_run(broadcast_buffers, steps=10):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 10)).to(device)
    model = DDP(net, broadcast_buffers=broadcast_buffers)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with distlab.watch(model, checksum_every=1):
        for step in range(steps):
            rows = mine[step * 32:(step + 1) * 32]
            loss = F.cross_entropy(model(X[rows]), Y[rows])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            distlab.log(loss=loss)
    trained = net[1].running_mean.clone()            # right after the last training step
    model.eval()
    with torch.no_grad():
        out = model(probe)                           # evaluation, through the DDP wrapper
    trained_nets[broadcast_buffers] = net
    # what the notebook pulls, on the CPU
    return {"after training": trained.cpu(), "after an eval forward": net[1].running_mean.clone().cpu(),
            "eval output": out.cpu()}

trained_nets = {}
bn = bn_run(broadcast_buffers=False)

# %% [markdown]
# With `broadcast_buffers=False`: `distlab.watch` compares checksums of the **parameters**, and they
# agree. The buffers do not, and neither do the two ranks' answers on the same 64 samples:

# %%
import torch

bn = lab.pull("bn")

def same(key):
    return torch.equal(bn[0][key], bn[1][key])

print(verdict().message)
print(f"largest difference between the ranks' eval outputs: "
      f"{(bn[0]['eval output'] - bn[1]['eval output']).abs().max():.3f}")

# %% tags=["nbval-check-output"]
print("parameters diverged (distlab.watch):", verdict().diverged)
print("running_mean equal on both ranks:", same("after an eval forward"))
print("eval outputs equal on both ranks:", same("eval output"))

# %%
happened = ("weights" if verdict().diverged else "same" if same("after an eval forward")
            else "stats" if same("eval output") else "both")
bn_guess.reveal(happened)

# %% [markdown]
# The checksums say *that* the replicas differ; `distlab.divergence(model, batch)` says *where* they
# part. Every rank calls it in a cell: it runs one step of the model on rank 0's batch (sent to every
# rank first, so the inputs agree), hashes the outputs of every op torch runs, exactly, on every rank,
# and compares the ranks op by op. The first op whose outputs differ while every op before it agreed
# must have used state that differs: it names the op, the module it ran in, and that module's
# parameters and buffers that differ between the ranks. On the model trained without
# `broadcast_buffers`, in evaluation mode:

# %% tags=["nbval-check-output"]
# %%ddp
print(distlab.divergence(trained_nets[False], probe))

# %% [markdown]
# Now the default, `broadcast_buffers=True`:

# %%
# %%ddp
bn = bn_run(broadcast_buffers=True)

# %% tags=["nbval-check-output"]
bn = lab.pull("bn")
print("right after the last training step, running_mean equal:", same("after training"))
print("after one more forward through DDP, equal:", same("after an eval forward"))
print("and they are rank 0's:", all(torch.equal(bn[r]["after an eval forward"], bn[0]["after training"]) for r in bn))
print("eval outputs equal on both ranks:", same("eval output"))

# %% [markdown]
# So with the default the buffers are equal whenever a forward through DDP starts, and rank 0's win.
# In between they are not: each training forward moves every rank's buffers toward its own batch,
# after the broadcast. Evaluate through the wrapper (or on rank 0), and save rank 0's copy, and the
# result is consistent. But look at *what* the buffers hold: rank 0's statistics, from rank 0's 32
# samples per step, not from the global batch of 64; and in training mode every rank normalises with
# its own batch's mean and variance. With small batches per device those are noisy estimates: MegDet
# (Peng et al., 2018) trained an object detector on 256 images over 128 GPUs, 2 per GPU, and
# introduced Cross-GPU Batch Normalization for that reason.
#
# `torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)` fixes that: its BatchNorm layers compute the
# mean and variance over the **global** batch in training mode (each rank's batch mean, inverse standard
# deviation and count are all-gathered and combined: `torch/nn/modules/_functions.py`), so every rank
# normalises with the same statistics and keeps the same running ones. It runs on accelerators only
# (CUDA, XPU, HPU and the like); on these CPU ranks it refuses:

# %%
# %%ddp
sync_net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
    torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32)).to(device))
try:
    sync_net(X[mine[:32]])
except ValueError as exc:
    if rank == 0:
        print(type(exc).__name__, exc)
else:
    if rank == 0:
        print(f"on {device} it runs: the statistics came from both ranks' batches")

# %% [markdown]
# So compute what it computes, by hand: the count and the sum of the BatchNorm layer's input,
# all-reduced, give the global mean; the summed squared deviations from it, all-reduced, give the
# global variance. Compare them with one BatchNorm layer in this notebook that sees the two ranks'
# batches put together (rank 0 holds samples 0, 2, ..., 62 and rank 1 samples 1, 3, ..., 63: together,
# the first 64).

# %%
# %%ddp
torch.manual_seed(0)
layer = torch.nn.Linear(64, 32).to(device)           # the layer before the BatchNorm, equal on every rank
with torch.no_grad():
    h = layer(X[mine[:32]])                          # what BatchNorm normalises: this rank's 32 samples
count, total = torch.tensor([float(len(h))], device=device), h.sum(0)
dist.all_reduce(count)
dist.all_reduce(total)
global_mean = total / count
squares = ((h - global_mean) ** 2).sum(0)
dist.all_reduce(squares)
global_var = squares / count                         # biased: the variance BatchNorm normalises with
local_mean, local_var = h.mean(0).cpu(), h.var(0, unbiased=False).cpu()
global_mean, global_var = global_mean.cpu(), global_var.cpu()   # the notebook pulls these four: on the CPU

# %% [markdown]
# BatchNorm normalises with the biased variance and keeps the unbiased one (x n / (n - 1)) in
# `running_var`; with `momentum=1.0` its running statistics are exactly the last batch's:

# %% tags=["nbval-check-output"]
from sklearn.datasets import load_digits

X_all = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0
torch.manual_seed(0)
layer = torch.nn.Linear(64, 32)
one = torch.nn.BatchNorm1d(32, momentum=1.0)
with torch.no_grad():
    one(layer(X_all[:64]))                           # one model, the combined batch of 64

stats = {name: lab.pull(name) for name in ("global_mean", "global_var", "local_mean", "local_var")}

def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)

print("every rank's global statistics equal one BatchNorm on the combined batch:",
      all(close(stats["global_mean"][r], one.running_mean)
          and close(stats["global_var"][r] * 64 / 63, one.running_var) for r in (0, 1)))
print("each rank's own batch statistics differ from them:",
      all(not close(stats["local_mean"][r], one.running_mean) for r in (0, 1)))

# %% [markdown]
# ## Where the time goes: a profiler
#
# When a step is slow, `torch.profiler` shows where. On a DDP step the gloo all-reduce shows up as
# its own entry, next to the matrix multiplies of forward and backward:

# %%
# %%ddp
from torch.profiler import ProfilerActivity, profile

torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device))
x = torch.randn(64, 256, device=device)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3):
        model(x).sum().backward()
events = [e.key for e in prof.key_averages()]
if rank == 0:
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8))

# %% tags=["nbval-check-output"]
events = lab.pull("events", ranks=0)[0]
print("an all-reduce appears in the profile:", any("all_reduce" in e or "allreduce" in e for e in events))

# %% [markdown]
# The `ERROR` and `USDT` lines around the table are not from this cell's code. `ERROR: External init
# callback must run in same thread as registerClient` comes from Kineto, the library under
# `torch.profiler`: distlab imports torch on a helper thread while a rank starts (it starts sooner),
# and Kineto, started here from the rank's main thread, prints this and skips a start-up callback of
# its client (PyTorch's, which sets up the memory profiler of Meta's MTIA accelerators: nothing a
# CPU profile uses). The `USDT` lines are Kineto's own log of the profiler starting and stopping.
# The profile is complete.
#
# The profiler records an event for every operator call, which costs time on every call: profile a
# few steps (as here, or with `torch.profiler.schedule(wait=..., warmup=..., active=...)` inside a
# long loop), not a whole run. For watching a whole run cheaply, `distlab.watch` samples what it
# measures.
#
# ## Init-order mistakes
#
# The notebook's own process has `torch.distributed` too, but it is not a rank: nothing has been
# initialised here. Everything that asks about the group fails until `init_process_group` has run:

# %% tags=["nbval-check-output"]
import socket
import torch.distributed as dist

print("initialised here?", dist.is_initialized())
try:
    dist.get_rank()
except ValueError as exc:
    print("get_rank() before init:", exc)


# %% [markdown]
# `init_process_group(backend, rank=..., world_size=...)` needs the two together: a rank alone means
# nothing without the size of the world. With `init_method="env://"` (the default) they come from
# the environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), which `torchrun` sets; with a
# TCP address they must be passed:

# %% tags=["nbval-check-output"]
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

try:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0)
except ValueError as exc:
    print("rank without world_size:", str(exc).split(": ")[-1])

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
print("after init: rank", dist.get_rank(), "of", dist.get_world_size(), "on", dist.get_backend())
dist.destroy_process_group()
print("after destroy_process_group:", dist.is_initialized())

# %% [markdown]
# A world of one is a fine way to test a script's plumbing. The rest of the checklist, in the order a
# script runs it:
#
# 1. `init_process_group(backend)` first: **nccl** for GPUs, **gloo** for CPUs (or as a fallback),
#    **mpi** where an MPI library is built in;
# 2. on GPUs, `torch.cuda.set_device(local_rank)` before creating tensors, so rank 3 on a node does not
#    allocate on GPU 0;
# 3. `DistributedDataParallel(model, device_ids=[local_rank])` (on CPU: no `device_ids`);
# 4. a `DistributedSampler` for the data (notebook 02);
# 5. at the end, `destroy_process_group()`.
#
# A rank that never arrives at `init_process_group` makes the others wait at the rendezvous: check
# that `MASTER_ADDR` is rank 0's address **as the other hosts see it** (not `localhost` across
# machines), that the port is open in the firewall, and that every host agrees on `WORLD_SIZE`.
#
# The same ideas in other frameworks: PyTorch's FSDP (sharded data parallelism, notebook 06);
# TensorFlow's `MirroredStrategy` (one machine), `MultiWorkerMirroredStrategy` (all-reduce across
# machines) and `ParameterServerStrategy`; JAX's `pmap` and `shard_map`.
#
# ## Build it yourself
#
# The exercise nearest this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on
# ranks the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise diverged-replicas`: the drift this lab caused on purpose, found the cheap way: which
#   parameters' replicas differ across the ranks, bit for bit, from a few bytes of fingerprint each
#   rather than the parameters themselves.
#
# ## Practice

# %%
# %quiz pitfalls -n 4

# %%
# %quiz torch-distributed-api -n 3

# %%
# %dist stop
