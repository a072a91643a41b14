# %% [markdown]
# # 18 · Debugging distributed training: hangs, stragglers and replicas that part
#
# Notebook 10 made the classic mistakes on purpose. This one is about *finding* them the way a
# practitioner does on a job that misbehaves, with four tools:
#
# | tool | what it answers |
# |---|---|
# | live stacks, `lab.stacks()` / `%dist stacks` | where is every rank **now**, while it hangs? (py-spy reads each process from outside) |
# | the hang's diagnosis | which collective or send, in which process group, did which ranks never reach? |
# | `distlab.divergence(model, batch)` | at which op of a step do replicas that should agree first differ? |
# | `lab.profile(steps=N)` / `%dist profile` | where does each rank's step go: compute, communication, waiting? |
#
# Four faults, each made on purpose on 4 ranks, each found with one of them: a deadlock between
# pairs of ranks, a hang inside one dimension of a 2-D device mesh, replicas that part after a
# checkpoint is loaded on one rank, and a rank that makes everyone slow.

# %%
# %load_ext distlab
# %dist start -n 4

# %% [markdown]
# ## 1. A deadlock, read from the ranks' live stacks
#
# Ranks 0 and 1 swap a tensor, and so do ranks 2 and 3. Each rank sends its own, then receives its
# peer's. On gloo (and on NCCL) a blocking `send` returns only once the peer's receive has taken the
# data, so every rank waits in its `send` for a `recv` that its peer will post only after its own
# `send` returns: none ever does.
#
# The notebook's main thread is busy while the ranks hang, waiting in `lab.run`. Another thread can
# still ask where the ranks are: `lab.stacks()` reads every rank's Python frames from outside its
# process (py-spy, a dependency of distlab), so it answers even from a rank stuck inside gloo's C++.
# In JupyterLab, the distlab side panel's **Stacks** button does the same while a cell runs; after
# the cell, `%dist stacks` prints them.

# %% tags=["raises-exception"]
import sys
import threading

import distlab

lab = distlab.current_lab()
swap = """
peer = rank ^ 1                                   # 0 <-> 1, 2 <-> 3
mine = torch.full((1024,), float(rank), device=device)
theirs = torch.empty(1024, device=device)
dist.send(mine, peer)                             # each rank sends first...
dist.recv(theirs, peer)                           # ...so no rank gets here
"""
threading.Timer(2.0, lambda: print(lab.stacks())).start()   # 2 s into the hang, from another thread
lab.run(swap, timeout=5)

# %% [markdown]
# The stacks, 2 s in, say that all four ranks are at the cell's `dist.send`, inside it. At the
# cell's deadline distlab stops them, and its error says the same from the other side: every send
# and receive a rank posts is recorded (torch's own flight recorder keeps collectives, and on gloo no
# point-to-point operations), so the n-th send from one rank to another can be matched against the
# n-th receive its peer posted. Here none was posted, in two pairs that wait on each other:

# %% tags=["nbval-check-output"]
stuck = sys.last_value        # the error the cell above raised (IPython keeps the last one)
print(type(stuck).__name__)
print(*(note for note in stuck.notes if "deadlock" in note), sep="\n")

# %% [markdown]
# The fix posts both at once and then waits: `dist.batch_isend_irecv` (or `isend` and `irecv`). The
# order between a send and a receive no longer matters, and neither blocks the other. (Posting the
# receive first on the odd ranks, by rank parity, also works.)

# %% tags=["nbval-check-output"]
# %%ddp
peer = rank ^ 1
mine = torch.full((1024,), float(rank), device=device)
theirs = torch.empty(1024, device=device)
ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
print("every value came from my peer:", bool(theirs.eq(peer).all()))

# %% [markdown]
# A pipeline's stages talk the same way, one stage's activations sent to the next: a stage that skips
# a step leaves the previous one waiting in its send, and the diagnosis names both ranks and the
# pipeline's process group (`torch.distributed.pipelining`, tested in distlab's suite).
#
# ## 2. A hang inside one dimension of a device mesh
#
# Four ranks as a 2 x 2 mesh: tensor parallelism inside pairs of ranks (`tp`: ranks 0-1 and 2-3) and
# FSDP2 across them (`dp`: ranks 0,2 and 1,3), as notebook 15 ended. A small MLP trains three steps
# on every rank:

# %%
# %%ddp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.Tanh()).to(device)
parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(mlp, mesh=mesh["dp"])
opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
for step in range(3):
    torch.manual_seed(100 + step)
    loss = mlp(torch.randn(8, 16, device=device)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if rank == 0:
    print(f"trained: loss {loss.item():.4f}")

# %% [markdown]
# Then a habit from DDP: validate on rank 0 only. Under DDP a forward needs nobody (every rank holds
# the whole model). Under FSDP2 each rank holds a shard of every parameter, and a forward first
# all-gathers the layer's weights from the other ranks of its `dp` group. Predict before you run it:
# which ranks will the error name, and in which group?

# %% tags=["raises-exception"]
# %%ddp --timeout 5
if rank == 0:
    with torch.no_grad():
        val = mlp(torch.randn(8, 16, device=device)).square().mean()
    print(f"validation loss {val.item():.4f}")

# %% [markdown]
# Rank 0 waits in FSDP2's all-gather in its `dp` group (ranks 0 and 2); rank 2 never came, because
# its cell had finished. The group's own numbering says how far each got: rank 2's last collective
# in that group, #6, was the previous step's gradient reduction (the whole gradient of its
# tensor-parallel shard, 1072 values; the all-gather brings back the other half of the 536 each
# rank keeps). The `tp` groups and the other `dp` group agree, so they are not named:

# %% tags=["nbval-check-output"]
print(*(note for note in sys.last_value.notes if note.startswith("collective")), sep="\n")

# %% [markdown]
# The fix: every rank runs the forward, and only the printing is rank 0's. (The process group was
# rebuilt to release rank 0, so the mesh and the model are made again.)

# %% tags=["nbval-check-output"]
# %%ddp
mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.Tanh()).to(device)
parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(mlp, mesh=mesh["dp"])
with torch.no_grad():
    torch.manual_seed(7)
    val = mlp(torch.randn(8, 16, device=device)).square().mean()
if rank == 0:
    print("validation ran on every rank: a finite loss", bool(torch.isfinite(val)))

# %% [markdown]
# ## 3. Replicas that part
#
# A fine-tuning run starts from a pretrained classifier head. Only rank 0 reads the checkpoint (it is
# the one that opened the file), after the model was wrapped in DDP, whose constructor broadcast rank
# 0's weights to the others *before* the head was loaded. From then on the replicas differ in the
# head, and nothing fails: DDP averages gradients, so each replica moves by the same update and the
# difference stays forever.
#
# `distlab.divergence(model, batch)` runs one step of the model on rank 0's batch on every rank,
# hashes the output of every op torch runs, exactly, and names the first op whose outputs differ
# between replicas, with the module it ran in and that module's state that differs:

# %% tags=["nbval-check-output"]
# %%ddp
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(device)
torch.manual_seed(1)
pretrained_head = nn.Linear(32, 10).to(device).state_dict()   # stands for the checkpoint's head
model = DDP(net)
if rank == 0:
    net[2].load_state_dict(pretrained_head)                     # after DDP's broadcast: the bug
print(distlab.divergence(model, torch.randn(16, 64, device=device)))

# %% [markdown]
# Every op of the body agreed; the replicas part at the head's first op, the transpose of its weight
# (`t`, before its matrix multiply), and the head's weight and bias differ: rank 0 against the three
# others. Load the checkpoint on every rank, or before wrapping in DDP:

# %% tags=["nbval-check-output"]
# %%ddp
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(device)
if rank == 0:
    net[2].load_state_dict(pretrained_head)
model = DDP(net)                                                # broadcasts rank 0's weights, head included
print(distlab.divergence(model, torch.randn(16, 64, device=device)))

# %% [markdown]
# ## 4. A rank that makes everyone slow, found in a profile
#
# DDP on the digits, 4 ranks, where rank 1's data loader is slow: it sleeps 0.1 s before each batch
# (a slow disk, a busy preprocessing worker, a shared file system). No rank fails; every step just
# takes longer. Which rank is it?
#
# `lab.profile(steps=5)` arms torch.profiler on every rank for the next cell: after its first
# optimizer step and one warm-up step, it records 5 steps, then merges the ranks' traces into one
# file (one process per rank, which Perfetto at ui.perfetto.dev opens) and reads, per rank, as
# Holistic Trace Analysis defines them: **compute** (here, the top-level ops of the training thread),
# **communication** (the time gloo's collectives ran), **exposed communication** (communication that
# no compute overlapped), **overlap** and **idle** time (neither). `%dist profile --steps 5` does the
# same for the next `%%ddp` cell and shows the profile under it.

# %%
# %%ddp
import time

import torch.nn.functional as F
from sklearn.datasets import load_digits

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32, device=device) / 16.0
Y = torch.tensor(digits.target, device=device)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
SLOW_LOADER_S = 0.1

def next_batch(step):
    if rank == 1:
        time.sleep(SLOW_LOADER_S)            # this rank's data loader is slow
    rows = (torch.arange(32, device=device) * world_size + rank + step * 32 * world_size) % len(Y)
    return X[rows], Y[rows]

# %%
import os
import tempfile

prof = lab.profile(steps=5, path=os.path.join(tempfile.mkdtemp(), "slow-rank.json"))

# %%
# %%ddp
for step in range(8):
    x, y = next_batch(step)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

# %%
prof

# %% [markdown]
# Every rank's step lasts as long (about 0.1 s), since the gradient all-reduce cannot end before
# the last rank has arrived. The straggler is the rank that spends the **least** time in
# communication and the most idle: ranks 0, 2 and 3 arrive at each all-reduce early and wait in it
# for rank 1, and the profile counts that wait as their (exposed) communication; rank 1 arrives
# last, after its sleep, and its all-reduce ends almost at once.

# %% tags=["nbval-check-output"]
rows = {row["rank"]: row for row in prof.table()}
idlest = max(rows, key=lambda r: rows[r]["idle_ms"])
least_waiting = min(rows, key=lambda r: rows[r]["communication_ms"])
print("steps profiled per rank:", sorted({row["steps"] for row in rows.values()}))
print("the rank idle longest:", idlest, "| the rank that waited least in its all-reduces:", least_waiting)

# %% [markdown]
# What the others waited, per step, against what rank 1 slept (the others' wait also holds rank 1's
# own compute before its all-reduce, and under load its lateness to be scheduled):

# %%
slept_ms = 1000 * lab.pull("SLOW_LOADER_S")[1]
others = [r for r in rows if r != least_waiting]
waited = sum(rows[r]["communication_ms"] - rows[least_waiting]["communication_ms"] for r in others) / len(others)
per_step = waited / rows[0]["steps"]
print(f"the others waited {per_step:.0f} ms more per step than rank {least_waiting}; it slept {slept_ms:.0f} ms per step")
print("most of the sleep shows up as the others' wait:", per_step > 0.5 * slept_ms)

# %% [markdown]
# The lesson generalises: in a synchronous job, the slow rank is the one that *does not* wait. Its
# cause is in what it does before the collective (here its data; elsewhere a slower GPU, a thermal
# throttle, another job on its node). The dashboard's straggler view (notebook 00) names it from
# every step's all-reduce times while training runs; the profile says what the rank was doing
# instead.
#
# ## Practice

# %%
# %quiz pitfalls -n 3

# %%
# %dist stop
