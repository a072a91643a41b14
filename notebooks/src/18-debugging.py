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
# peer's. On gloo a blocking `send` returns only once the peer's receive has taken the data, so
# every rank waits in its `send` for a `recv` that its peer will post only after its own `send`
# returns: none ever does. (On NCCL the host would not wait there: a blocking call makes the current
# CUDA stream wait, as PyTorch's "Synchronous and asynchronous collective operations" says, so the
# same deadlock sits on the stream and shows later, at the next synchronisation or in the watchdog's
# timeout.)
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

# %%
from distlab.quiz import predict

named = predict("Only rank 0 runs a forward of the FSDP2 x TP model (a 2 x 2 mesh: dp, tp). What will the hang name?",
                choices={"dp": "rank 0 waiting in its dp group (ranks 0 and 2); rank 2 never came",
                         "tp": "rank 0 waiting in its tp group (ranks 0 and 1); rank 1 never came",
                         "world": "rank 0 waiting for all three others, in the world's group",
                         "none": "nothing: rank 0 holds what its forward needs"},
                answer="dp")
named

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
# Your prediction against the group the check named:

# %%
hang = next(note for note in sys.last_value.notes if note.startswith("collective"))
named.reveal("dp" if "mesh_dp of ranks 0,2" in hang else "tp" if "mesh_tp" in hang else "world")

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
# ## 5. One FSDP2 step, collective by collective
#
# The tools so far look at a world after something went wrong. A **breakpoint on a collective**
# stops every rank just before a collective and hands the notebook back: `lab.pause(...)` (or
# `%dist break`) arms the next cell; while the ranks wait, `lab.paused` is a table of what each rank
# is about to run (op, process group, the cell's line, and the shape, dtype, norm and a hash of each
# tensor it sends), `lab.pull(name)` reads the paused cell's variables, `lab.step()` (`%dist step`)
# lets every rank run that collective and stops it before the next, and `lab.cont()`
# (`%dist continue`) runs the cell to its end. The ranks stop themselves, counting the collectives
# whoever launches them: FSDP2's all-gathers and reduce-scatters, DDP's bucket all-reduces, DTensor's.
#
# Below, a two-layer MLP is sharded with FSDP2 over the 4 ranks: each `Linear` is a unit, and the
# root holds no parameter of its own. FSDP2 keeps each parameter as a `DTensor` sharded along its first
# dimension. Before a unit runs forward, every rank sends its shards of that unit's parameters,
# packed into one flat buffer, in an all-gather, and receives everyone's; after backward, the unit's
# gradients, unsharded, go into a reduce-scatter that leaves each rank the sum of its own shard
# (`torch.distributed.fsdp.fully_shard`'s documentation; notebook 15 measures the memory this saves).
#
# Predict first: the first unit is `Linear(64, 256)`, a weight of 256 x 64 and a bias of 256.

# %%
# %%ddp
from torch.distributed.fsdp import fully_shard

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(device)
for unit in (mlp[0], mlp[2], mlp):
    fully_shard(unit)
mlp_opt = torch.optim.SGD(mlp.parameters(), lr=0.1)

# %%
from distlab.quiz import predict


def shard_numbers(rows: int, cols: int, ranks: int) -> float:
    """What one rank holds of a Linear(cols, rows): its rows of the weight and of the bias (dim 0 split)."""
    return rows // ranks * cols + rows // ranks


sent = predict("How many numbers does each rank send in the first all-gather (Linear(64, 256) on 4 ranks)?",
               theory=shard_numbers, tolerance=0.01, rows=256, cols=64, ranks=4)
sent

# %% [markdown]
# Now the step, stopped before its first all-gather, then stepped through to its end. Each stop is
# kept in a list: where the ranks were, and what each sent.

# %%
STEP = """
x = torch.randn(32, 64, device=device)
mlp(x).square().mean().backward()
mlp_opt.step()
mlp_opt.zero_grad()
"""
lab.pause(op="all_gather")
paused = lab.run(STEP).paused
first_sent = paused.rows[0].shapes[0][0]
sent.reveal(first_sent)
stops = []
while paused is not None:
    stops.append(paused)
    paused = lab.step()
print(f"{'#':>2}  {'op':<15} {'line':>4}  what each rank sends")
for stop in stops:
    row = stop.rows[0]
    print(f"{stop.index:>2}  {stop.op:<15} {row.line:>4}  {list(row.shapes[0])} {row.dtypes[0]}")

# %% [markdown]
# In order: the first unit's all-gather before its forward, then the second's. FSDP2 frees a unit's
# gathered parameters after its forward (`reshard_after_forward=True`), so backward gathers both again:
# the second unit's first, and the first unit's ahead of its turn (a prefetch, issued before the second
# unit's gradients are reduced). Then the gradients are reduce-scattered, the second unit's first. A
# reduce-scatter's input is the unit's whole unsharded gradient, 4 times what each rank sent in its
# all-gather. Every collective sits on the cell's line 2: forward and backward are both on it. The
# ranks agreed at every stop (no row marked), and the step ended as it would have unpaused.

# %% tags=["nbval-check-output"]
gathers = [s.rows[0].shapes[0][0] for s in stops if s.op == "all_gather"]
scatters = [s.rows[0].shapes[0][0] for s in stops if s.op == "reduce_scatter"]
print("each rank sent its shard of Linear(64, 256), 64 x 64 + 64 numbers, in the first all-gather:", gathers[0] == 4160)
print("and of Linear(256, 64), 16 x 256 + 16, in the second:", gathers[1] == 4112)
print("each reduce-scatter took 4 x a unit's shard:", sorted(scatters) == sorted(4 * g for g in set(gathers)))
print("every rank ran the same collective at every stop:", all(not s.disagree for s in stops))

# %% [markdown]
# ## 6. A collective only some ranks reach, found three ways
#
# The most common bug of this subject: a collective inside a branch on the rank. Here rank 0 alone
# averages a loss for its log, and then every rank meets at a barrier. Rank 0's all-reduce waits
# for ranks that are already in the barrier: on gloo the two can even pair up and return with wrong
# values, or wait until the deadline (notebook 10).

# %%
BUGGY = """
loss = torch.ones(1, device=device) * rank
if rank == 0:                                     # only rank 0 logs the mean loss
    dist.all_reduce(loss)
dist.barrier()
"""

# %% [markdown]
# **First, before it runs**: the lint reads the cell and names the collective under a branch on the
# rank (`%%ddp` prints it before every cell; `--strict` refuses to run the cell).

# %% tags=["nbval-check-output"]
for finding in distlab.lint(BUGGY):
    print(finding)

# %% [markdown]
# **Second, at the call**: a lab started with `debug=True` (`%dist start --debug`) runs torch's own
# check of every collective (TORCH_DISTRIBUTED_DEBUG=DETAIL): before a collective runs, the ranks
# compare what they are about to run, and a mismatch stops the cell at once, one line for each call.
# A second, 2-rank lab shows it.

# %% tags=["nbval-check-output"]
with distlab.start(ranks=2, debug=True, timeout=60) as checked:
    try:
        checked.run(BUGGY, stream=False)
    except distlab.RankError as failure:
        print(failure.notes[0].split(" (torch's")[0])
        print("each rank's call is named:", "rank 0: all_reduce" in failure.notes[0] and "rank 1: barrier" in failure.notes[0])

# %% [markdown]
# **Third, stopped before it**: a breakpoint at the first collective of the cell. Every rank stops
# at its own first collective, and the table marks the one that differs from the rest.

# %%
lab.pause(at=1)
paused = lab.run(BUGGY, timeout=30).paused
paused

# %% tags=["nbval-check-output"]
print("rank 0 alone would all-reduce:", paused.disagree == [0], [r.op for r in paused.rows])
print("at line 4, as the lint said:", paused.rows[0].line == 4, "| the others at line 5, the barrier:",
      {r.line for r in paused.rows[1:]})

# %% [markdown]
# Stepping on would run the mismatch. A restart ends the paused cell (its ranks are stopped) and
# brings a fresh world:

# %%
lab.restart()
print("paused:", lab.paused)

# %% [markdown]
# ## Practice

# %%
# %quiz pitfalls -n 3

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise diverged-replicas`: find the parameters whose replicas differ across the ranks, bit
#   for bit, from a fingerprint of each (a few bytes) rather than the parameters themselves.

# %%
# %dist stop
