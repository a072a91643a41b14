# %% [markdown]
# # 01 · Data parallelism from scratch
#
# Data parallelism is the simplest way to use more than one device: every worker holds a **full copy**
# of the model, works on a **different slice** of the data, and before each update the workers agree
# on one gradient by **averaging** theirs. Because every copy starts from the same weights and applies
# the same averaged gradient, the copies never drift apart.
#
# In this lab you will
#
# 1. average gradients by hand with `all_reduce`, and check that the two replicas stay bit-identical;
# 2. check that this is exactly one model trained on the two batches put together;
# 3. let `DistributedDataParallel` (DDP) do the same thing for you, and watch it live;
# 4. read the training round as a table: who does what, step by step.
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
model = make_model()
w = distlab.watch(model, stats_every=1, checksum_every=1)
for step in range(STEPS):
    xb, yb = batch_for(rank, world_size, step)
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
manual = [p.detach().clone() for p in model.parameters()]
print(f"last loss on my batch: {loss.item():.3f}")

# %% [markdown]
# The ranks saw different data and had different losses, but they should hold the very same
# weights. Pull them back and compare them bit for bit:

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
# per layer, whether the replicas agree, and the measured link speed.

# %%
# %%ddp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ddp_model = DDP(make_model())
opt = torch.optim.SGD(ddp_model.parameters(), lr=LR)
w = distlab.watch(ddp_model, stats_every=1, checksum_every=1)
for step in range(STEPS):
    xb, yb = batch_for(rank, world_size, step)
    loss = F.cross_entropy(ddp_model(xb), yb)
    opt.zero_grad(set_to_none=True)
    loss.backward()                   # the all-reduce happens in here, bucket by bucket
    opt.step()
    distlab.log(loss=loss, epoch=0)
w.close()
with_ddp = [p.detach().clone() for p in ddp_model.module.parameters()]

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
# aggregated -> the model is updated everywhere -> repeat. Here are the last two steps of the DDP run,
# as the ranks recorded them (the numbers are live measurements; the actions and the global state are
# what the round must look like):

# %%
rows = analysis.trace_rows(records, [0, 1], last_steps=2)
print(f"{'step':>4} {'epoch':>5} {'rank':>4}  {'action':<45} {'local state':<38} global state")
for r in rows:
    print(f"{r.step:>4} {r.epoch:>5} {r.rank:>4}  {r.action:<45} {r.local:<38} {r.world}")

# %% [markdown]
# The same table without the live numbers, so that a change in what the round does is caught:

# %% tags=["nbval-check-output"]
for r in rows:
    print(r.step, r.rank, r.action.split(" (")[0], "|", r.world)

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

# %%
# %dist stop
