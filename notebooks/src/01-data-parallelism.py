# %% [markdown]
# # 01 · Data parallelism from scratch
#
# Data parallelism is the simplest way to use more than one device: every worker holds a **full copy**
# of the model, works on a **different slice** of the data, and before each update the workers agree
# on one gradient by **averaging** theirs. Because every copy starts from the same weights and applies
# the same averaged gradient, the copies' weights never drift apart (a model's *buffers*, such as
# BatchNorm's running statistics, are not gradients: notebook 10 shows what happens to them).
#
# In this lab you will
#
# 1. average gradients by hand with `all_reduce`, and check that the two replicas stay bit-identical;
# 2. check that this is exactly one model trained on the two batches put together;
# 3. let `DistributedDataParallel` (DDP) do the same thing for you, and watch it live;
# 4. read a run of your own as a table, step by step: who does what, local and global state.
#
# Everything runs on 2 CPU ranks (gloo) started by distlab.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## The data and the model
#
# scikit-learn ships a small real data set: 1,797 handwritten digits, 8x8 pixels each. We define,
# **in the notebook**, the data, a small model and a function that gives rank `r` its batch for a
# step. Rank `r` owns every second sample starting at `r`, so the two ranks never see the same sample.
# `lab.push` copies these names to every rank.

# %%
import torch
import torch.nn.functional as F
import distlab
from sklearn.datasets import load_digits

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32) / 16.0   # [1797, 64], pixels in 0..1
y = torch.tensor(digits.target)                               # [1797], labels 0..9
BATCH, STEPS, LR = 32, 30, 0.5                                # BATCH is per rank

def batch_for(rank, world_size, step):
    """Rank `rank`'s batch at `step`: its slice is samples rank, rank + world_size, ..."""
    mine = torch.arange(rank, len(X), world_size)
    pick = torch.arange(step * BATCH, (step + 1) * BATCH) % len(mine)
    return X[mine[pick]], y[mine[pick]]

def make_model():
    torch.manual_seed(0)            # the same seed everywhere: every replica starts equal
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

lab = distlab.current_lab()
lab.push(X=X, y=y, BATCH=BATCH, STEPS=STEPS, LR=LR, batch_for=batch_for, make_model=make_model)

# %% [markdown]
# ## Step 1: averaging gradients by hand
#
# Each rank runs forward and backward on its own batch. Then, for every parameter, `all_reduce`
# adds up the ranks' gradients and leaves the sum on every rank; dividing by `world_size` makes it
# the average. Every rank then applies the same update.
#
# `distlab.watch(model)` records each step (loss, time, every all-reduce, a checksum of the weights);
# `w.all_reduce` is `dist.all_reduce` timed as part of the step. The dashboard appears under the cell
# as soon as telemetry arrives.

# %%
# %%ddp
import torch.nn.functional as F
model = make_model().to(device)
w = distlab.watch(model, stats_every=1, checksum_every=1)
for step in range(STEPS):
    xb, yb = batch_for(rank, world_size, step)
    xb, yb = xb.to(device), yb.to(device)
    loss = F.cross_entropy(model(xb), yb)
    model.zero_grad(set_to_none=True)
    loss.backward()
    for p in model.parameters():
        w.all_reduce(p.grad)          # sum over ranks, result on every rank ...
        p.grad /= world_size          # ... then the average
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad          # the same update on every rank
    distlab.log(loss=loss)
w.close()
manual = [p.detach().cpu().clone() for p in model.parameters()]   # the notebook takes CPU tensors
print(f"last loss on my batch: {loss.item():.3f}")

# %% [markdown]
# The ranks saw different data and had different losses, but they should hold the very same
# weights. (The dashboard's line about the link fits the ring model to these all-reduces; tensors
# of 40 bytes to 8 KB cost almost nothing but latency, so the bandwidth it fits here means nothing:
# notebook 03 measures the link with sizes up to 16 MB.) Pull the weights back and compare them
# bit for bit:

# %% tags=["nbval-check-output"]
manual = lab.pull("manual")                      # {rank: [tensor, ...]}
print("replicas identical:", all(torch.equal(a, b) for a, b in zip(manual[0], manual[1])))

# %% [markdown]
# ## Step 2: it is one model trained on a bigger batch
#
# The loss is a mean over the batch, so the average of two ranks' gradients (32 samples each) is
# the gradient of the mean over all 64 samples. Train one model in this notebook on both batches
# put together, and it lands on the same weights (up to float rounding): data parallelism changes
# how the work is spread, not what is computed. The **global batch** here is 32 x 2 = 64.

# %% tags=["nbval-check-output"]
reference = make_model()
opt = torch.optim.SGD(reference.parameters(), lr=LR)
for step in range(STEPS):
    xs, ys = zip(*(batch_for(r, 2, step) for r in range(2)))
    loss = F.cross_entropy(reference(torch.cat(xs)), torch.cat(ys))
    opt.zero_grad()
    loss.backward()
    opt.step()
same = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(reference.parameters(), manual[0]))
print("one process on the combined batch of", 2 * BATCH, "gives the same weights:", same)

# %% [markdown]
# ## Step 3: the same with DDP
#
# `DistributedDataParallel` does step 1 for you, and does it better: it broadcasts rank 0's weights
# when it wraps the model (so replicas start equal even without the seed), groups gradients into
# **buckets**, and starts all-reducing a bucket while the backward pass is still computing the
# rest, so communication overlaps computation. Here the model is small enough to fit in one bucket.
#
# The dashboard under the cell shows the loss of each rank, the all-reduce timeline, gradient norms
# per layer, whether the replicas agree, and what the all-reduces say about the link (not much here:
# one bucket of 9.6 KB a step, a single size, so it does not fit the ring model).

# %%
# %%ddp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ddp_model = DDP(make_model().to(device))
opt = torch.optim.SGD(ddp_model.parameters(), lr=LR)
w = distlab.watch(ddp_model, stats_every=1, checksum_every=1)
for step in range(STEPS):
    xb, yb = batch_for(rank, world_size, step)
    xb, yb = xb.to(device), yb.to(device)
    loss = F.cross_entropy(ddp_model(xb), yb)
    opt.zero_grad(set_to_none=True)
    loss.backward()                   # the all-reduce happens in here, bucket by bucket
    opt.step()
    distlab.log(loss=loss, epoch=0)
w.close()
with_ddp = [p.detach().cpu().clone() for p in ddp_model.module.parameters()]   # the notebook takes CPU tensors

# %% tags=["nbval-check-output"]
with_ddp = lab.pull("with_ddp")
print("replicas identical:", all(torch.equal(a, b) for a, b in zip(with_ddp[0], with_ddp[1])))
print("DDP agrees with the hand-written version:",
      all(torch.allclose(a, b, atol=1e-5) for a, b in zip(with_ddp[0], manual[0])))

# %% [markdown]
# The same dashboard is always at hand as `lab.dashboard()`; in a saved notebook it keeps a text
# summary of what it showed. Its divergence check compares the exact checksums the ranks published:

# %%
board = lab.dashboard()
board

# %% tags=["nbval-check-output"]
from distlab.dashboard import analysis
records = lab.telemetry.records()
print(analysis.divergence(records, lab.telemetry.meta()).message)

# %% [markdown]
# ## Step 4: the training round as a table
#
# One round of data-parallel training is always the same sequence: split the data -> every worker
# holds the model -> each trains on its slice -> they share gradients -> the gradients are
# aggregated -> the model is updated everywhere -> repeat. To see every step of it, train a small run
# of **2 epochs of 6 steps**, by hand as in step 1, and record what the table needs:
#
# * each rank owns a contiguous shard of 96 samples (rank 0: samples 0..95, rank 1: 96..191) and
#   trains on 16 of them per step, so an epoch is 6 steps, and epoch 1 goes over the same samples
#   again in the same order (notebook 02 shuffles them with `DistributedSampler` instead);
# * `distlab.watch(model, stats_every=1, checksum_every=1)` records, at every step, the loss, the
#   timed all-reduces, the norms of the gradient and of the weights, and an exact checksum of the
#   weights after the update;
# * `distlab.log` adds what only the loop knows: which samples the rank trained on, the norm of the
#   rank's **own** gradient before the exchange, and the first three values of the output layer's
#   bias (`peek`), a few numbers you can read.

# %%
SHARD, PER_STEP, EPOCHS = 96, 16, 2          # per rank: 96 samples, 16 a step, so 6 steps an epoch

def shard_batch(rank, i):
    """Rank `rank`'s i-th batch of an epoch: samples first..last of its contiguous shard."""
    first = rank * SHARD + i * PER_STEP
    return first, first + PER_STEP - 1, X[first:first + PER_STEP], y[first:first + PER_STEP]

def peek(model, prefix="w"):
    """The first three values of the output layer's bias, as {"w0": ..., "w1": ..., "w2": ...}."""
    return {f"{prefix}{i}": v for i, v in enumerate(model[-1].bias.detach()[:3].tolist())}

lab.push(SHARD=SHARD, PER_STEP=PER_STEP, EPOCHS=EPOCHS, shard_batch=shard_batch, peek=peek)

# %%
# %%ddp
model = make_model().to(device)
w = distlab.watch(model, stats_every=1, checksum_every=1)
distlab.log(**peek(model, "start_w"))                # what every replica starts from
for epoch in range(EPOCHS):
    for i in range(SHARD // PER_STEP):
        first, last, xb, yb = shard_batch(rank, i)
        xb, yb = xb.to(device), yb.to(device)
        loss = F.cross_entropy(model(xb), yb)        # forward ...
        model.zero_grad(set_to_none=True)
        loss.backward()                              # ... and backward, on this rank's samples only
        own = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
        for p in model.parameters():
            w.all_reduce(p.grad)                     # share: every rank gets the sum of the gradients
        for p in model.parameters():
            p.grad /= world_size                     # aggregate: the sum becomes the average
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad                     # update: the same step on every replica
        distlab.log(loss=loss, epoch=epoch, samples_from=first, samples_to=last, own_grad_norm=own,
                    **peek(model))
w.close()

# %% [markdown]
# Now the table, built from what your ranks recorded (`lab.telemetry`). Every step has a
# forward/backward row per rank (its own samples, its own loss and gradient: **local state**), one
# all-reduce row and one aggregate row for the whole world, and an update row per rank; the last row
# is the exit. The **global state** is the model the replicas share. In data parallelism it is stored
# nowhere else: the table shows the checksum of the weights all ranks agree on (an exact integer sum
# of the weights' bit patterns; its low 32 bits in hex), and would say "none" where they differ.

# %%
from distlab.dashboard import rounds

table = rounds.round_table(lab.telemetry.records(), lab.telemetry.meta())
table

# %% [markdown]
# Read it down one step: the two losses and the two own-gradient norms differ (different samples),
# the averaged gradient is one number for the world, and after the update both ranks hold the same
# weights, which the next step's forward starts from. What must hold of every synchronous round,
# checked on your table:

# %% tags=["nbval-check-output"]
for fact, value in table.facts().items():
    print(f"{fact}: {value}")

# %% [markdown]
# ### The status tracker
#
# The same run at four moments: the global weights and each rank's local weights, as a checksum and
# the three values `peek` logged.

# %%
tracker = table.tracker(after=(5, 10))
tracker

# %% tags=["nbval-check-output"]
print([point.when for point in tracker.points])
print("every rank's local weights equal the global ones at each:",
      all(point.locals_equal_global() for point in tracker.points))
print("the global weights differ from one moment to the next:",
      len({point.global_checksum for point in tracker.points}) == len(tracker.points))

# %% [markdown]
# ### Questions on your table
#
# These are graded against the table above: the answers are your ranks' own numbers.

# %%
table.quiz()

# %% [markdown]
# Two ways to break the round, and what they do:
#
# * **no aggregation** (each rank keeps its own gradient): the replicas drift apart at the first
#   step, and no single "global model" exists any more (notebook 10 shows this live);
# * **no update**: the workers keep computing gradients on the same, stale weights; nothing is learned.
#
# ## Practice
#
# A few questions, graded in Python (the live ones run on your ranks):

# %%
# %quiz data-parallelism -n 3

# %%
# %quiz training-round -n 3

# %% [markdown]
# Stop the ranks: every process distlab started is gone afterwards.

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise average-gradients`: `average_gradients(model)`, what step 1 did by hand, graded against DDP's gradients at 2 and 3 ranks.

# %%
# %dist stop
