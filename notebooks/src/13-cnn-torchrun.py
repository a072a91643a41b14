# %% [markdown]
# # 13 · A CNN, from a torchrun script into the notebook and back
#
# Most distributed training code you will meet is a script started by `torchrun`:
#
# ```
# torchrun --standalone --nproc_per_node=2 cnn_ddp.py --epochs 2
# ```
#
# `torchrun` starts one process per rank and gives each its place in the world through environment
# variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); the script calls
# `init_process_group`, trains, and calls `destroy_process_group`. This lab takes such code into the
# notebook as it is, trains a small CNN with everything a real job has (a `DistributedSampler` with
# `set_epoch`, Adam, test loss and accuracy all-reduced, logging from rank 0), and takes the
# notebook's cells back out as a script that `torchrun` runs, checking that it trains the very same
# weights.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## The ranks are what torchrun would have started
#
# Each rank carries torchrun's variables, so code that reads them works unchanged:

# %%
# %%ddp
import os
env = {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
print({name: env[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})

# %% tags=["nbval-check-output"]
import distlab

lab = distlab.current_lab()
env = lab.pull("env")
print("RANK matches the lab's rank on every rank:", all(int(env[r]["RANK"]) == r for r in env))
print("WORLD_SIZE:", {env[r]["WORLD_SIZE"] for r in env})
print("one MASTER_ADDR and MASTER_PORT for all:", len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env.values()}) == 1)

# %% [markdown]
# A torchrun script starts with a `setup()` like the one below. In the notebook the process group
# already exists (distlab made it when the ranks started), so a call of `init_process_group` that
# matches the lab joins it with a note instead of failing; one that cannot match (another world
# size, `nccl` on CPU ranks) says what to change. `destroy_process_group()` leaves the lab's group
# for `%dist stop` to end.

# %%
# %%ddp
import torch.distributed as dist

def setup(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    # no backend named: torch takes NCCL where there are GPUs, gloo where there are none
    dist.init_process_group(rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

setup(rank, world_size)
print("initialised:", dist.is_initialized(), "| rank", dist.get_rank(), "of", dist.get_world_size())

# %% [markdown]
# ## Data shaped like CIFAR-10, made here
#
# Nothing is downloaded, so the data set is made in the cell: 32 x 32 colour images in 10 classes.
# Each class has a smooth random pattern; an image is its class's pattern under noise six times as
# strong, so the classes can be told apart, but not at a glance: the model needs a few epochs. Every rank makes the same data from the same
# seed; the `DistributedSampler` then gives each rank its own half of it.

# %%
# %%ddp
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

def cifar_like(n, seed):
    """n images [3, 32, 32] with labels 0-9: a smooth pattern per class plus noise.

    The data set stays on the CPU, where the DataLoader reads it: each batch goes to `device` as it is used."""
    patterns = F.interpolate(torch.randn(10, 3, 4, 4, generator=torch.Generator().manual_seed(0)),  # CPU data
                             size=32, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)                      # CPU data
    images = patterns[labels] + 6.0 * torch.randn(n, 3, 32, 32, generator=g)   # CPU data
    return TensorDataset(images, labels)

train_set, test_set = cifar_like(4096, seed=1), cifar_like(1024, seed=2)
train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
test_sampler = DistributedSampler(test_set, shuffle=False)
train_loader = DataLoader(train_set, batch_size=64, sampler=train_sampler)   # no shuffle=True: the sampler shuffles
test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)
if rank == 0:
    print(f"{len(train_set)} training images, {len(train_sampler)} per rank; {len(test_set)} test images")

# %% [markdown]
# ## The model and one epoch
#
# The classic small CNN: two convolutions with pooling, then three linear layers (62 thousand
# parameters). DDP averages its gradients; Adam updates every replica the same way.
#
# The test pass is where global metrics come from: each rank counts its own loss sum, correct
# answers and samples, and one all-reduce of the three sums gives the numbers for the whole test set.
# Only rank 0 prints them.

# %%
# %%ddp
from torch.nn.parallel import DistributedDataParallel as DDP

class SimpleCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 6, 5)
        self.conv2 = torch.nn.Conv2d(6, 16, 5)
        self.pool = torch.nn.MaxPool2d(2, 2)
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 120)
        self.fc2 = torch.nn.Linear(120, 84)
        self.fc3 = torch.nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

def train_epoch(model, loader, optimizer):
    model.train()
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()                       # DDP all-reduces the gradients here
        optimizer.step()

def evaluate(model, loader):
    """Test loss and accuracy over the whole test set: per-rank sums, all-reduced."""
    model.eval()
    sums = torch.zeros(3, device=device)      # loss sum, correct, samples
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            logits = model(images)
            sums += torch.tensor([F.cross_entropy(logits, labels, reduction="sum").item(),
                                  (logits.argmax(1) == labels).sum().item(), len(labels)], device=device)
    dist.all_reduce(sums)
    return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()

torch.manual_seed(0)                          # the same initial weights on every rank
model = DDP(SimpleCNN().to(device))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
history = []
for epoch in range(2):
    train_sampler.set_epoch(epoch)            # a new shuffle each epoch, the same on every rank
    train_epoch(model, train_loader, optimizer)
    test_loss, accuracy = evaluate(model, test_loader)
    history.append((test_loss, accuracy))
    if rank == 0:
        print(f"epoch {epoch}: test loss {test_loss:.3f}, accuracy {accuracy:.1%}")

# %% [markdown]
# What must hold: every rank computed the same global metrics (they come from one all-reduce), the
# replicas are identical, and the model learned something (10 classes: chance is 10%).

# %% tags=["nbval-check-output"]
histories = lab.pull("history")
print("every rank has the same global test metrics:", histories[0] == histories[1])
print("accuracy after 2 epochs is well above chance (10%):", histories[0][-1][1] > 0.5)
print("test loss fell from epoch 0 to epoch 1:", histories[0][1][0] < histories[0][0][0])

# %%
# %%ddp
checksum = sum(p.double().sum().item() for p in model.parameters())

# %% tags=["nbval-check-output"]
sums = lab.pull("checksum")
print("replicas identical after training:", sums[0] == sums[1])

# %% [markdown]
# ## Challenge: a log per rank
#
# Rank 0's log says what happened to the *job*. When one rank misbehaves you want each rank's own
# story: write a log file per rank (`logs/rank0.log`, `logs/rank1.log`) with that rank's *local*
# test accuracy (its half of the test set, before the all-reduce) next to the global one. Try it in
# the empty cell; the cell after it is one answer, and the check reads the files.

# %%
# %%ddp
# your per-rank logging here

# %%
# %%ddp
import logging

def local_accuracy(model, loader):
    correct = total = 0
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            correct += (model(images).argmax(1) == labels).sum().item()
            total += len(labels)
    return correct / total

os.makedirs("logs", exist_ok=True)
log = logging.getLogger(f"cnn.rank{rank}")
log.setLevel(logging.INFO)
log.propagate = False                         # this rank's file only, not the engine's console
handler = logging.FileHandler(f"logs/rank{rank}.log", mode="w")
handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
log.addHandler(handler)
log.info(f"local accuracy {local_accuracy(model, test_loader):.3f}, global {history[-1][1]:.3f}")
handler.close()
log.removeHandler(handler)

# %% tags=["nbval-check-output"]
import os

logs = {name: open(os.path.join("logs", name)).read() for name in sorted(os.listdir("logs"))}
print("one log file per rank:", sorted(logs))
print("each file holds its own rank's line:", all(text.startswith(f"[rank {name[4]}]") for name, text in logs.items()))

# %% [markdown]
# ## Leaving the notebook: the cells as a torchrun script
#
# Rank 0 saves the trained weights. Then `%dist export` writes every `%%ddp` cell run so far (those
# that succeeded, in order) as one script, with a header that makes what the notebook gave each rank
# (`rank`, `world_size`, `local_rank`, `device`, the process group) from torchrun's variables.

# %%
# %%ddp
if rank == 0:
    torch.save(model.module.state_dict(), "cnn_final.pt")

# %%
import torch

notebook_weights = torch.load("cnn_final.pt", map_location="cpu")     # this process never starts CUDA
os.remove("cnn_final.pt")

# %%
# %dist export cnn_export.py

# %%
print(open("cnn_export.py").read()[:1500])

# %% [markdown]
# Run the script with torchrun, in a process of its own, as you would on a cluster (here:
# `--standalone`, two processes on this machine, one thread each as the lab's ranks have). It trains
# from scratch, saves `cnn_final.pt`, and exits; then compare its weights with the notebook's. First,
# what do you expect?

# %%
from distlab.quiz import predict

export_guess = predict(
    "torchrun trains the exported script from scratch, in two new processes. Its final weights, against "
    "the notebook's:",
    choices={"equal": "equal, bit for bit: the same ops on the same data in the same order",
             "close": "close but not equal: two runs of float arithmetic never agree exactly",
             "apart": "different: the processes start from different random states"},
    answer="equal",
)
export_guess

# %%
import subprocess
import sys

run = subprocess.run(
    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "cnn_export.py"],
    capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
)
print("torchrun exit status:", run.returncode)
print("\n".join(line for line in run.stdout.splitlines() if line.startswith("epoch")))
script_weights = torch.load("cnn_final.pt", map_location="cpu")

# %% tags=["nbval-check-output"]
print("torchrun ran the exported script:", run.returncode == 0)
print("same tensors:", script_weights.keys() == notebook_weights.keys())
print("the script's final weights equal the notebook's, bit for bit:",
      all(torch.equal(script_weights[k], notebook_weights[k]) for k in notebook_weights))

# %%
bitwise = all(torch.equal(script_weights[k], notebook_weights[k]) for k in notebook_weights)
close = all(torch.allclose(script_weights[k], notebook_weights[k], atol=1e-4) for k in notebook_weights)
export_guess.reveal("equal" if bitwise else "close" if close else "apart")

# %% [markdown]
# ## Entering the notebook: a torchrun script run on the ranks
#
# The other way round: a script written for torchrun, unchanged, run on the lab's ranks as
# `__main__` with its own arguments. Here is the shape such scripts have (`cnn_ddp.py`: setup from
# torchrun's variables, the same CNN on the same made-up data, and `cleanup()` at the end):

# %%
# %%writefile cnn_ddp.py
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def setup():
    """This rank's device, and the process group (no backend named: NCCL on GPUs, else gloo)."""
    device = torch.device("cpu")
    # NCCL needs a GPU of its own for each process (init_process_group's documentation: sharing one
    # can deadlock), so the ranks use the GPUs only where every local rank has one.
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return device


def cleanup():
    dist.destroy_process_group()


def cifar_like(n, seed):
    patterns = F.interpolate(torch.randn(10, 3, 4, 4, generator=torch.Generator().manual_seed(0)),
                             size=32, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(patterns[labels] + 6.0 * torch.randn(n, 3, 32, 32, generator=g), labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    device = setup()
    rank = dist.get_rank()
    data = cifar_like(4096, seed=1)                   # the notebook's training set
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(4),
                                    torch.nn.Flatten(), torch.nn.Linear(8 * 7 * 7, 10)).to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(3, device=device)         # loss sum, correct, samples
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad(set_to_none=True)
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            loss.backward()
            optimizer.step()
            right = (logits.argmax(1) == labels).sum().item()
            total += torch.tensor([loss.item() * len(labels), right, len(labels)], device=device)
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch}: mean training loss {total[0] / total[2]:.3f}, accuracy {total[1] / total[2]:.3f}")
    print(f"rank {rank} of {dist.get_world_size()}: done")
    cleanup()


if __name__ == "__main__":
    main()

# %% [markdown]
# `%dist run` sends the file to every rank and runs it there as `__main__`, with `sys.argv` set as
# torchrun would set it. Its `setup()` joins the lab's group, its `cleanup()` leaves it standing, and
# its output comes back labelled by rank. A model that guesses among 10 classes has a loss of
# ln 10 = 2.30 and an accuracy of 10%: the first epoch's mean starts above that (its first steps'
# losses are large); by the second the model is well past chance.

# %%
# %dist run cnn_ddp.py --epochs 2

# %% [markdown]
# The lab is still whole after the script's `cleanup()`: the next cell's collectives work.

# %%
# %%ddp
ones = torch.ones(1, device=device)
dist.all_reduce(ones)
ones = ones.cpu()                             # the notebook pulls it: on the CPU

# %% tags=["nbval-check-output"]
print("the lab's group outlived the script's cleanup():", {r: v.item() for r, v in lab.pull("ones").items()})

# %% [markdown]
# ## Build it yourself
#
# The exercise nearest this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on
# ranks the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise distributed-sampler`: the sampler the script and the notebook both used, built by hand:
#   each rank a disjoint, covering, padded share of the data, reshuffled each epoch by `set_epoch`.
#
# ## Practice

# %%
# %quiz torch-distributed-api -n 3

# %%
# %quiz metrics-logging -n 2

# %%
# %dist stop

# %%
import shutil

for path in ("cnn_final.pt", "cnn_export.py", "cnn_ddp.py"):
    if os.path.exists(path):
        os.remove(path)
shutil.rmtree("logs", ignore_errors=True)
