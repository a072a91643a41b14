# %% [markdown]
# # 00 · Start here
#
# distlab turns this notebook into the driver of a small distributed training job. Each **rank** is a
# separate Python process (an ipyparallel engine) holding its own copy of the model; `torch.distributed`
# connects the ranks. On a GPU machine each rank gets one GPU and the ranks talk over NCCL; here, with no
# GPU, they run on the CPU and talk over gloo. Nothing is simulated: what you see below really ran on two
# processes.
#
# Load the extension and start two ranks:

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# Every `%%ddp` cell now runs on **every** rank. Each rank already has `rank`, `world_size`,
# `local_rank`, `device`, `torch`, `dist` (`torch.distributed`, initialised) and `distlab`. Output is
# streamed while the cell runs and labelled by rank:

# %%
# %%ddp
print(f"hello from rank {rank} of {world_size} on {device}")

# %% [markdown]
# `%dist status` is the rank table: which process is which rank, where it runs, and whether it is
# healthy. Ranks are explicit: a rank is not the engine id, and on several machines ranks are grouped by
# host.

# %%
# %dist status

# %% [markdown]
# ## A first collective
#
# `all_reduce` sums a tensor across the ranks and leaves the sum on every rank. Ranks 0 and 1 contribute
# `rank + 1`, so both end with 1 + 2 = 3. A cell's last expression is shown for each rank, in rank order:

# %% tags=["nbval-check-output"]
# %%ddp
t = torch.tensor([rank + 1.0], device=device)
dist.all_reduce(t)
t.item()

# %% [markdown]
# ## A first DDP model, watched
#
# `DistributedDataParallel` averages the gradients across ranks during `backward()`, so every replica
# takes the same step and the replicas stay identical although each rank trains on different data. Here
# the data are scikit-learn's handwritten digits (1,797 images of 8x8 pixels, shipped with the package):
# each rank takes every second image, its own shard.
#
# `distlab.watch(model)` records what each rank does: the loss (`distlab.log`), every all-reduce of a
# bucket of gradients (below) with its bytes and time, per-layer gradient and weight norms, and a checksum of the weights. The
# dashboard appears under the cell while it trains; when the cell ends it becomes a picture of its
# last state, which the saved notebook keeps. (What a rank displays shows too, under its label: HTML,
# figures, tables, widgets, and `tqdm` bars, one row per rank.)
#
# Its words, before you see them (each has a notebook of its own later):
#
# - **step** time: one optimizer step on the rank, forward, backward and update;
# - **exposed all-reduce**: the part of the gradient all-reduces that the backward did not hide, the
#   time the step waited for communication (DDP groups the gradients into **buckets**, 25 MiB each by
#   default (`bucket_cap_mb`), and all-reduces a bucket as soon as the backward has filled it, while
#   the backward goes on; notebook 03);
# - **busbw**, bus bandwidth: an all-reduce's bytes over its time, scaled by 2(N-1)/N so that it reads
#   as the speed of each link of the ring (NCCL's nccl-tests define it so); fitted against the ring
#   model once there are all-reduces of several sizes (notebooks 03 and 12);
# - **replicas agree**: the weights' checksums are equal on every rank (notebook 10 makes them differ);
# - **memory** against theory: what the model's state takes on each rank, next to the formula
#   (notebooks 06 and 15); the formula names the layout: "ddp, data x tensor parallel 2 x 1" is DDP
#   over 2 ranks, each holding whole layers (tensor parallelism, which splits a layer across ranks, is
#   notebook 05's);
# - **stragglers**: all-reduces that one rank reached last, so that the others waited for it, out of
#   all the all-reduces timed (notebook 18 finds the cause of one).

# %%
# %%ddp
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32, device=device)[rank::world_size] / 16   # this rank's shard
y = torch.tensor(digits.target, device=device)[rank::world_size]

torch.manual_seed(0)                      # the same initial weights on every rank
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.5)
with distlab.watch(model, stats_every=1, checksum_every=1):
    for step in range(40):
        batch = torch.arange(step * 16, step * 16 + 16, device=device) % len(x)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()                   # gradients are all-reduced here, bucket by bucket
        opt.step()
        distlab.log(loss=loss)
accuracy = (model(x).argmax(1) == y).float().mean().item()
weights = [p.detach().cpu().clone() for p in model.parameters()]   # the notebook takes CPU tensors
print(f"accuracy on my shard {accuracy:.2f}")

# %% [markdown]
# The same records are plain data in the notebook: one per rank per step. Every step all-reduced
# exactly the model's gradient bytes (4 bytes for each of its 64·32 + 32 + 32·10 + 10 = 2,410
# parameters):

# %% tags=["nbval-check-output"]
import distlab

lab = distlab.current_lab()               # the Lab that %dist start made
records = lab.telemetry.records()
print(len(records), "records from ranks", sorted({r["rank"] for r in records}))
print("bytes all-reduced per step:", {sum(b["bytes"] for b in r["allreduce"]) for r in records})

# %% [markdown]
# Pull the weights back by rank and compare them: the replicas are identical, bit for bit.

# %% tags=["nbval-check-output"]
import torch

w = lab.pull("weights")                   # {rank: [tensor, ...]}
print("replicas identical:", all(torch.equal(a, b) for r in w for a, b in zip(w[0], w[r])))

# %% [markdown]
# ## When a rank fails
#
# A failure on one rank is reported once, with the rank named. Rank 0 would otherwise wait in the
# all-reduce for rank 1 until the timeout; distlab stops it at once, says where it was waiting, and
# rebuilds the process group.

# %% tags=["raises-exception"]
# %%ddp
def load_shard(index):
    shard = torch.arange(4.0, device=device) + index
    if rank == 1:
        raise ValueError("rank 1 read a corrupt shard")
    return shard


shard = load_shard(rank)
t = torch.ones(1, device=device)
dist.all_reduce(t)

# %% [markdown]
# `%dist debug` looks inside the rank that failed: its frames, from the cell down to the failing line,
# with their local variables (tensors by shape, dtype and a few statistics), read from the rank's own
# traceback, which it keeps until its next cell.

# %% tags=["nbval-check-output"]
# %dist debug

# %% tags=["nbval-check-output"]
# %%ddp
t = torch.ones(1, device=device)
dist.all_reduce(t)   # the group works again
t.item()

# %% [markdown]
# ## A first quiz
#
# Questions are graded in Python; numeric answers come from `distlab.theory`. `%quiz` with no topic
# shows how far you are in each of the 15 topics.

# %%
# %quiz data-parallelism -n 3 --seed 2

# %% [markdown]
# Stop the ranks when you are done: every process distlab started is gone afterwards.

# %%
# %dist stop
