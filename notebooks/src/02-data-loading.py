# %% [markdown]
# # 02 · Feeding the ranks: DistributedSampler, and metrics that mean something
#
# Data parallelism only pays off if each rank works on **its own** part of the data. PyTorch's
# `DistributedSampler` hands every rank a disjoint slice of the data set's indices, reshuffled each
# epoch, provided you tell it which epoch it is with `set_epoch(epoch)`. This lab checks that claim
# the honest way: every rank records the ids of the samples it was given, and the notebook counts them.
#
# Then the other half of the story: once each rank sees only part of the data, its loss and accuracy
# are only part of the answer. Global metrics come from **all-reduced sums**, and only rank 0 logs.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## A data set that tells you which sample you got
#
# The digits data set again (1,797 images), as a `TensorDataset` whose items also carry their
# **index**. The function that builds it is defined here in the notebook and pushed to the ranks.

# %% tags=["nbval-check-output"]
import torch
import distlab
from distlab import theory
from sklearn.datasets import load_digits

digits = load_digits()

def make_data():
    """The digits as a TensorDataset of (image [64], label, index)."""
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    return torch.utils.data.TensorDataset(x, y, torch.arange(len(y)))

N = len(make_data())
lab = distlab.current_lab()
lab.push(make_data=make_data)
print("samples:", N)

# %% [markdown]
# ## Three epochs without `set_epoch`
#
# Each rank builds a `DistributedSampler` (it reads the rank and world size from the initialised
# process group) and a `DataLoader` that uses it. Note: **no `shuffle=True` on the DataLoader** when a
# sampler is given; the sampler does the shuffling (the DataLoader refuses both at once).
#
# Predict first: with 1,797 samples and 2 ranks, how many samples does each rank get per epoch?

# %%
from distlab.quiz import predict

per_rank_guess = predict("1,797 samples, 2 ranks, DistributedSampler's defaults: how many samples does each "
                         "rank get per epoch?", theory="samples_per_rank", unit="", tolerance=0.0005,
                         dataset_size=N, world_size=2)
per_rank_guess

# %%
# %%ddp
from torch.utils.data import DataLoader, DistributedSampler

data = make_data()
sampler = DistributedSampler(data, shuffle=True, seed=0)     # num_replicas, rank: from the group
loader = DataLoader(data, batch_size=64, sampler=sampler)
seen_forgot = []                                              # ids per epoch, no set_epoch
for epoch in range(3):
    seen_forgot.append(torch.cat([ids for _, _, ids in loader]).tolist())
print(f"{len(sampler)} samples per epoch on this rank; first five of each epoch:",
      [ids[:5] for ids in seen_forgot])


# %% [markdown]
# The notebook counts what the ranks were given. Per epoch: how many ids in all, how many distinct,
# and how many the two ranks had in common.

# %% tags=["nbval-check-output"]
def count(seen):
    """seen: {rank: [ids of epoch 0, ids of epoch 1, ...]}"""
    for epoch in range(len(seen[0])):
        a, b = seen[0][epoch], seen[1][epoch]
        print(f"epoch {epoch}: {len(a)} + {len(b)} ids, {len(set(a) | set(b))} unique, "
              f"{len(set(a) & set(b))} on both ranks")

forgot = lab.pull("seen_forgot")
count(forgot)
print("same order every epoch on rank 0:", forgot[0][0] == forgot[0][1] == forgot[0][2])

# %%
per_rank_guess.reveal(len(forgot[0][0]))

# %% [markdown]
# Every sample is covered each epoch: 1,797 unique ids. Each rank gets ceil(1797 / 2) = 899, so
# the sampler **pads** by repeating one sample, which is why one id shows up on both ranks. The
# formulas, from `distlab.theory`:

# %% tags=["nbval-check-output"]
print("samples per rank:", theory.samples_per_rank(N, 2),
      "| padding:", theory.sampler_padding_samples(N, 2),
      "| with drop_last:", theory.samples_per_rank(N, 2, drop_last=True))

# %% [markdown]
# But the order is the **same every epoch**: the sampler shuffles with `seed + epoch`, and its epoch
# stayed 0. The model sees the same batches in the same order again and again, which hurts
# generalisation and is easy to miss. Now the same with `sampler.set_epoch(epoch)` at the top of each
# epoch:

# %%
# %%ddp
seen = []
for epoch in range(3):
    sampler.set_epoch(epoch)          # a new shuffle each epoch, the same one on every rank
    seen.append(torch.cat([ids for _, _, ids in loader]).tolist())

# %% tags=["nbval-check-output"]
seen = lab.pull("seen")
count(seen)
print("same order every epoch on rank 0:", seen[0][0] == seen[0][1] == seen[0][2])
print("epoch 0 unchanged:", seen[0][0] == forgot[0][0])

# %% [markdown]
# Still disjoint (the ranks agree on the shuffle because they share the seed and the epoch), still
# complete, and now a fresh order each epoch.
#
# ## Two ways to get it wrong
#
# **No sampler at all**, just `shuffle=True`: every rank walks through the *whole* data set. The
# run is twice as expensive and each "epoch" is really two.

# %%
# %%ddp
plain = DataLoader(data, batch_size=64, shuffle=True)
no_sampler = [torch.cat([ids for _, _, ids in plain]).tolist()]
try:
    DataLoader(data, batch_size=64, sampler=sampler, shuffle=True)
except ValueError as exc:
    refused = str(exc)

# %% tags=["nbval-check-output"]
count(lab.pull("no_sampler"))
print("DataLoader with both sampler and shuffle=True:", lab.pull("refused", ranks=0)[0])

# %% [markdown]
# ## Global metrics: all-reduce sums, log from rank 0
#
# Now train for a few epochs with DDP. Each rank knows the loss and the number of correct answers
# **on its own samples** only. To report the global numbers, each rank all-reduces two sums (loss
# sum, correct count) and the sample count; dividing gives the global mean. Averaging the ranks'
# means is only right when every rank saw the same number of samples.
#
# Only rank 0 prints (`master_process`), so the log says each thing once. `distlab.log` sends the
# loss and epoch to the dashboard, where the trace shows the epoch of each step.

# %%
# %%ddp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

master_process = rank == 0
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
w = distlab.watch(model)
for epoch in range(3):
    sampler.set_epoch(epoch)
    sums = torch.zeros(3, device=device)                      # loss sum, correct, samples
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        distlab.log(loss=loss, epoch=epoch)
        sums += torch.tensor([loss.item() * len(y), (out.argmax(1) == y).sum().item(), len(y)], device=device)
    dist.all_reduce(sums)                                     # the global sums, on every rank
    if master_process:
        print(f"epoch {epoch}: mean loss {sums[0] / sums[2]:.3f}, accuracy {sums[1] / sums[2]:.3f}")
w.close()

# %% [markdown]
# A check you can rely on: evaluate the trained model with each rank scoring its own part of the
# data, **unevenly split** on purpose (rank 0 gets 899 samples, rank 1 gets 898: no padding this
# time, so nothing is counted twice). The all-reduced sums must give exactly the accuracy of one
# process scoring all 1,797 samples.

# %%
# %%ddp
with torch.no_grad():
    mine = torch.arange(rank, len(data), world_size)    # indices into data: CPU, as data is
    x, y, _ = data[mine]
    x, y = x.to(device), y.to(device)
    correct = (model.module(x).argmax(1) == y).sum()
counts = torch.stack([correct, torch.tensor(len(mine), device=device)]).double()
local = counts.clone().cpu()                              # the notebook takes CPU tensors
dist.all_reduce(counts)
counts = counts.cpu()
weights = {k: v.cpu() for k, v in model.module.state_dict().items()}

# %%
net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
net.load_state_dict(lab.pull("weights", ranks=0)[0])
data = make_data()
with torch.no_grad():
    one_process = (net(data.tensors[0]).argmax(1) == data.tensors[1]).double().mean().item()

local, total = lab.pull("local"), lab.pull("counts")[0]
correct = [local[r][0].item() for r in (0, 1)]
samples = [local[r][1].item() for r in (0, 1)]
print("samples per rank:", [int(s) for s in samples])
print("all-reduced accuracy == one process:", total[0].item() / total[1].item() == one_process)
print("theory.global_mean agrees:", theory.global_mean(correct, samples) == one_process)
print(f"accuracy {one_process:.6f}; the mean of the ranks' accuracies would say "
      f"{(correct[0] / samples[0] + correct[1] / samples[1]) / 2:.6f}")

# %% tags=["nbval-check-output"]
print("samples per rank:", [int(s) for s in samples])
print("all-reduced accuracy == one process:", total[0].item() / total[1].item() == one_process)
print("theory.global_mean agrees:", theory.global_mean(correct, samples) == one_process)

# %% [markdown]
# Here the mean of means is off only in the last digits, because the split is nearly even and both
# halves are alike. It is off by `(a0 - a1)(n1 - n0) / 2N` for two ranks: it grows when the shards
# differ both in size and in difficulty. Unshuffled data sorted by label does that: say rank 1 read
# the last file, the 8s and 9s only, and rank 0 everything else. The same model, the same 1,797
# predictions, split that way:

# %%
with torch.no_grad():
    right = (net(data.tensors[0]).argmax(1) == data.tensors[1]).double()
late = data.tensors[1] >= 8                                  # rank 1's shard: the 8s and 9s
parts = [(right[~late].sum().item(), int((~late).sum())), (right[late].sum().item(), int(late.sum()))]
mean_of_means = sum(c / n for c, n in parts) / 2
print("samples per rank:", [n for _, n in parts], "| accuracy per rank:", [round(c / n, 3) for c, n in parts])
print(f"true accuracy {theory.global_mean([c for c, _ in parts], [n for _, n in parts]):.4f}, "
      f"the mean of the ranks' accuracies {mean_of_means:.4f}")
#
# The dashboard's view of the training (loss per rank; the trace shows the epoch):

# %%
lab.dashboard()

# %% [markdown]
# **Per-rank log files** help when debugging: rank 0's log says what happened *globally*, but when one
# rank misbehaves you want each rank's own story. Each rank writes its own file:

# %%
# %%ddp
import os, tempfile
log_dir = os.path.join(tempfile.gettempdir(), f"distlab-02-{os.getppid()}")
os.makedirs(log_dir, exist_ok=True)
with open(os.path.join(log_dir, f"rank{rank}.log"), "w") as f:
    f.write(f"rank {rank}: {int(local[1])} eval samples, {int(local[0])} correct\n")
dist.barrier()
if rank == 0:
    for name in sorted(os.listdir(log_dir)):
        print(name, "->", open(os.path.join(log_dir, name)).read().strip())
dist.barrier()
if rank == 0:
    import shutil
    shutil.rmtree(log_dir)

# %% [markdown]
# ## Practice

# %%
# %quiz data-loading -n 3

# %%
# %quiz metrics-logging -n 3

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise distributed-sampler`: a sampler of your own that gives each rank a disjoint, covering, padded slice and reshuffles with `set_epoch`.

# %%
# %dist stop
