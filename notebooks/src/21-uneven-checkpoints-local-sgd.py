# %% [markdown]
# # 21 · Uneven inputs, distributed checkpoints, and averaging less often
#
# Three things every real training run meets sooner or later, each on live ranks:
#
# 1. **Uneven inputs.** A rank with fewer batches than the others leaves the loop early, and the
#    others wait in the next all-reduce forever. DDP's `join()` (torch's `Join` context manager)
#    lets them finish.
# 2. **Distributed checkpoints.** `torch.distributed.checkpoint` (DCP) has every rank write its own
#    shards, plus one metadata file. We save an FSDP2 model from 4 ranks and load it on 2,
#    resharded on the way, bit for bit.
# 3. **Averaging less often.** Local SGD (Lin et al. 2018) averages the models every H steps instead
#    of the gradients every step. DiLoCo (Douillard et al. 2023) adds an outer optimizer on the
#    averaged change. The bytes sent fall as 1/H; we measure what that costs in loss.

# %%
# %load_ext distlab
# %dist start -n 4

# %%
import distlab
from distlab import theory

lab = distlab.current_lab()

# %% [markdown]
# ## Uneven inputs
#
# Each rank trains DDP on its own shard of batches, but rank 3's shard is two batches shorter: 5, 5,
# 5 and 3 batches. Every `backward()` under DDP ends in an all-reduce of the gradients that every
# rank must join. In the fourth step ranks 0-2 enter that all-reduce, and rank 3, done, never does.
# `--timeout 10` gives the cell 10 seconds; distlab then stops it and says who waited where.

# %%
# %%ddp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

BATCHES = [5, 5, 5, 3]                                   # rank 3's shard is shorter


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)


def shard(r):
    """Rank r's batches: the same wherever they are made."""
    g = torch.Generator().manual_seed(r)
    return [(torch.randn(16, 8, generator=g).to(device), torch.randn(16, 1, generator=g).to(device))
            for _ in range(BATCHES[r])]


def train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


batches = shard(rank)

# %% tags=["raises-exception"]
# %%ddp --timeout 10
model = DDP(make_model())
train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
print(f"rank {rank} finished its {len(batches)} batches")

# %% [markdown]
# Rank 3 finished; the other three were stopped inside DDP's all-reduce, waiting for it. With
# `model.join()` around the loop, a rank that runs out of batches stays in the loop's collectives
# without data: for each all-reduce the others still make, it adds zeros in their place. DDP's
# `join()` has one choice to make. By default (`divide_by_initial_world_size=True`) it still divides
# the sum by the world size it started with, so after rank 3 is done each step's gradient is 3/4 of
# the three ranks' mean. With `False` it divides by the ranks still training (torch's
# `DistributedDataParallel.join` documentation).

# %%
# %%ddp
def joined(divide_by_initial_world_size):
    model = DDP(make_model())
    with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
    return [p.detach().clone() for p in model.parameters()]


def by_hand(divide_by_initial_world_size):
    """One process: each step's gradients summed over the ranks that still have a batch."""
    model = make_model()
    shards = [shard(r) for r in range(world_size)]
    for step in range(max(BATCHES)):
        grads = []
        for r in range(world_size):
            if step < BATCHES[r]:
                model.zero_grad()
                x, y = shards[r][step]
                nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
        divide = world_size if divide_by_initial_world_size else len(grads)
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / divide
    return [p.detach() for p in model.parameters()]


uneven = {}
for initial in (True, False):
    weights = joined(initial)
    mine = torch.cat([w.flatten() for w in weights])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    reference = torch.cat([w.flatten() for w in by_hand(initial)])
    other = torch.cat([w.flatten() for w in by_hand(not initial)])
    uneven[initial] = {"replicas equal": all(torch.equal(e, mine) for e in everyone),
                       "from reference": (mine - reference).abs().max().item(),
                       "from the other rule": (mine - other).abs().max().item()}

# %%
uneven = lab.pull("uneven", 0)[0]
for initial, got in uneven.items():
    print(f"divide_by_initial_world_size={initial}: replicas equal {got['replicas equal']}; "
          f"largest difference from one process: {got['from reference']:.1e}, from the other rule: "
          f"{got['from the other rule']:.1e}")

# %% tags=["nbval-check-output"]
for initial, got in uneven.items():
    print(f"divide_by_initial_world_size={initial}: every rank's model equal, and one process's under "
          f"that rule to 1e-6, not the other's:",
          got["replicas equal"] and got["from reference"] < 1e-6 < got["from the other rule"])

# %% [markdown]
# Both runs end: ranks 0-2 take all 5 steps, rank 3 takes 3 and shadows the last 2. The models match
# one process that sums the gradients of the ranks that still have a batch and divides by 4, or by
# the ranks left. The two rules give different models. Dropping the last uneven batches
# (`DistributedSampler(drop_last=True)`, notebook 02) avoids the choice altogether.
#
# ## Distributed checkpoints: save at 4, load at 2
#
# An FSDP2 model's `state_dict()` holds each rank's shard of every parameter, as DTensors.
# `torch.distributed.checkpoint.save` has each rank write its shards to its own file, and the
# coordinator (rank 0) write the metadata that says where every piece of every tensor is. Nothing
# is gathered on one rank. `torch.save` of a gathered state dict is the one-file alternative, and it
# needs the whole model on the rank that writes.
#
# The model has 4 linear layers of 256 x 256. We train it for 2 steps on 4 ranks and save it with
# DCP. We also keep its full weights, gathered, to compare with later.

# %%
import os
import shutil
import tempfile

folder = tempfile.mkdtemp(prefix="distlab-dcp-")
lab.push(folder=folder)

# %%
# %%ddp
import os
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard


def fsdp_model():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


model = fsdp_model()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
for _ in range(2):
    x = torch.randn(32, 256, generator=g).to(device)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
saved = {name: p.full_tensor().clone() for name, p in model.state_dict().items()}   # whole, for the check only
dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(folder, "step-2"))
local_shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.state_dict().values())
if rank == 0:
    torch.save(saved, os.path.join(folder, "gathered.pt"))

# %%
step_dir = os.path.join(folder, "step-2")
files = {name: os.path.getsize(os.path.join(step_dir, name)) for name in sorted(os.listdir(step_dir))}
shards = lab.pull("local_shard_bytes")
full_bytes = os.path.getsize(os.path.join(folder, "gathered.pt"))
print("what DCP wrote:")
for name, size in files.items():
    print(f"  {name:<16} {size:>9,} bytes")
print("each rank's shards of the model:", ", ".join(f"rank {r} {b:,}" for r, b in shards.items()), "bytes")
print(f"torch.save of the gathered state: one file of {full_bytes:,} bytes, written by rank 0 alone")

# %% tags=["nbval-check-output"]
data_files = {name: size for name, size in files.items() if name.endswith(".distcp")}
print("one data file per rank, and one metadata file:", len(data_files) == 4 and ".metadata" in files)
print("each rank's file holds its shards (within 10% of them):",
      all(0.9 * shards[r] <= size <= 1.1 * shards[r] + 4096 for r, size in zip(range(4), data_files.values())))

# %% [markdown]
# Each rank wrote a quarter of the model, and the metadata file is small. Now a world of 2 ranks, as
# after a job lost half its nodes (`%dist restart -n 2`). The model is built again with FSDP2 on 2
# ranks, so each shard is half of every parameter now, not a quarter. `dcp.load` reads into those
# shards in place: each rank reads the pieces of the files that its new shards cover.

# %%
# %dist restart -n 2

# %%
lab.push(folder=folder)

# %%
# %%ddp
import os
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

torch.manual_seed(1)                                     # different weights: the load must overwrite them
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(device)
for layer in model:
    fully_shard(layer)
fully_shard(model)
state = {"model": model.state_dict()}
dcp.load(state, checkpoint_id=os.path.join(folder, "step-2"))
model.load_state_dict(state["model"])
saved = torch.load(os.path.join(folder, "gathered.pt"))
loaded = {name: p.full_tensor() for name, p in model.state_dict().items()}
resharded = {"world": world_size, "shard rows": model[0].weight.to_local().shape[0],
             "bit for bit": all(torch.equal(loaded[name], saved[name]) for name in saved)}

# %% tags=["nbval-check-output"]
resharded = lab.pull("resharded")
print(resharded)
print("loaded at 2 ranks, every parameter bit for bit as saved at 4:", all(r["bit for bit"] for r in resharded.values()))

# %%
shutil.rmtree(folder)

# %% [markdown]
# The checkpoint written by 4 ranks loaded on 2, each rank now holding 128 of a layer's 256 rows
# where it held 64. This is what an elastic job needs (notebook 09 resumes a whole-model checkpoint
# at another size). DCP also saves the optimizer's state (`get_state_dict` in
# `torch.distributed.checkpoint.state_dict`), and can write in the background (`async_save`).
#
# ## Averaging less often: local SGD and DiLoCo
#
# DDP all-reduces every gradient at every step. Local SGD lets each rank take H steps on its own
# data, then averages the models (one all-reduce of the parameters). That is 1/H of DDP's bytes,
# since parameters and gradients have the same size. In between, the models drift apart, the more
# so the more the ranks' data differ. DiLoCo treats the averaged change of the H steps as a
# gradient for an *outer* optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9 in the paper.
#
# The experiment: 4 ranks, each with its own regression task (its own teacher), the same number of
# steps (48) for each H. torch's `CommDebugMode` counts the collectives the averaging makes. A last
# run at H = 16 is watched: `distlab.watch` records the averaging's all-reduce, which comes after
# an update, in the record of the step it follows.
#
# **Predict first**: the bytes all-reduced per step, relative to DDP's, at H = 16. (The widget
# grades your guess against the theory; the ranks' count comes after they run.)

# %%
# %dist restart -n 4

# %%
from distlab.quiz import predict


def of_ddps_bytes(h):
    """Local SGD all-reduces the parameters once every h steps, DDP (H = 1) once a step."""
    return 1 / h


guess = predict("Local SGD averaging every H = 16 steps: what fraction of DDP's bytes does it all-reduce per step?",
                theory=of_ddps_bytes, tolerance=0.05, h=16)
guess

# %%
# %%ddp
import torch.nn as nn
from torch.distributed.tensor.debug import CommDebugMode

STEPS, LR = 48, 0.05


def local_sgd(h, outer=False, watched=False):
    """STEPS steps of SGD on this rank's task, the models averaged every h steps (DiLoCo's outer step if outer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    watch = distlab.watch(model, stats_every=0, checksum_every=0, publish=False) if watched else None
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    anchor = [p.detach().clone() for p in model.parameters()]       # the weights at the last average
    outer_opt = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True) if outer else None
    g = torch.Generator().manual_seed(rank)
    common = torch.randn(16, 1, generator=torch.Generator().manual_seed(7)).to(device)
    teacher = common + 0.5 * torch.randn(16, 1, generator=g).to(device)   # this rank's task: the common one, shifted
    calls, drift = 0, []
    for step in range(STEPS):
        x = torch.randn(64, 16, generator=g).to(device)
        inner.zero_grad()
        nn.functional.mse_loss(model(x), x @ teacher).backward()
        inner.step()
        if (step + 1) % h:
            continue
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        mean = flat.clone()
        with CommDebugMode() as counted:                             # torch's own count of collectives
            dist.all_reduce(mean)
        calls += counted.get_total_counts()
        mean /= world_size
        drift.append(((flat - mean).norm() / mean.norm()).item())   # how far this rank had gone its own way
        with torch.no_grad():
            chunks = mean.split([p.numel() for p in model.parameters()])
            for p, a, m in zip(model.parameters(), anchor, chunks):
                if outer_opt is None:
                    p.copy_(m.view_as(p))
                else:
                    a.grad = a - m.view_as(a)                        # DiLoCo's outer gradient
            if outer_opt is not None:
                outer_opt.step()
                for p, a in zip(model.parameters(), anchor):
                    p.copy_(a)
    if watch is not None:                                            # the steps whose record holds an all-reduce
        watch.close()
        return [r["step"] for r in watch.records() if any(c["op"] == "all_reduce" for c in r["collectives"])]
    with torch.no_grad():                                            # the averaged model on every rank's task
        x = torch.randn(256, 16, generator=torch.Generator().manual_seed(99)).to(device)
        loss = nn.functional.mse_loss(model(x), x @ teacher).reshape(1)
    dist.all_reduce(loss)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"all-reduces": calls, "bytes per step": calls * size / STEPS, "loss": loss.item() / world_size,
            "drift": sum(drift) / len(drift), "parameters": sum(p.numel() for p in model.parameters())}


local = {f"local SGD, H = {h}": local_sgd(h) for h in (1, 4, 16)}
local["DiLoCo, H = 16"] = local_sgd(16, outer=True)
averaged_in = local_sgd(16, watched=True)

# %%
local = lab.pull("local")
RUNS = ("local SGD, H = 1", "local SGD, H = 4", "local SGD, H = 16", "DiLoCo, H = 16")
params = local[0][RUNS[0]]["parameters"]
print(f"{params:,} parameters, {4 * params:,} bytes each all-reduce")
print(f"{'run':<18} {'bytes per step':>15} {'of H = 1':>9} {'drift before averaging':>23} {'loss after 48 steps':>20}")
base = local[0][RUNS[0]]["bytes per step"]
for name in RUNS:
    r = local[0][name]
    drift = sum(local[k][name]["drift"] for k in local) / len(local)
    print(f"{name:<18} {r['bytes per step']:>15,.0f} {r['bytes per step'] / base:>9.4f} {drift:>22.2%} {r['loss']:>20.4f}")

# %% tags=["nbval-check-output"]
counts = [local[0][name]["all-reduces"] for name in RUNS[:3]]
drifts = [sum(local[k][name]["drift"] for k in local) for name in RUNS[:3]]
print("bytes per step fall as 1/H (48, 12 and 3 all-reduces counted):", counts == [48, 12, 3])
print("H = 1 all-reduces the parameters once per step:", base == 4 * params)
print("the ranks' models drift further apart between averages as H grows:", drifts == sorted(drifts))
print("distlab.watch puts each average (H = 16) in the step it follows: steps 15, 31 and 47:",
      lab.pull("averaged_in") == {r: [15, 31, 47] for r in range(4)})

# %% [markdown]
# Your prediction against the bytes the ranks counted at H = 16, over H = 1's:

# %%
guess.reveal(local[0]["local SGD, H = 16"]["bytes per step"] / base)

# %% [markdown]
# With H = 1 local SGD averages the models after every step of SGD, which for SGD is the same as
# averaging the gradients: DDP. As H grows the bytes fall as 1/H, and between averages each rank's
# model goes further towards its own task: the drift column is how far, relative to the average,
# just before each average. What that costs in loss depends on how far the ranks' data differ and
# on the learning rates. Here the tasks are close, and the last column shows the losses of this one
# run side by side, not a law. DiLoCo sends the same bytes as local SGD at H = 16, and here it ends
# at a higher loss, for a reason that shows in the arithmetic: with 48 steps at H = 16 it takes 3
# outer steps, and Nesterov's first step at lr 0.7 and momentum 0.9 moves 0.7 x (1 + 0.9) = 1.33
# times the averaged change, then momentum keeps pushing the same way: on a task this small, past
# where local SGD's plain average stops. Its outer momentum was tuned for language models, with H =
# 500 inner AdamW steps over many outer steps, where the paper reports a loss close to synchronous
# training's for 500 times fewer exchanges (Douillard et al. 2023); three outer steps are not that
# regime.
#
# ## Practice

# %%
# %quiz data-parallelism -n 2 --seed 21

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise diloco-outer-step`: DiLoCo's outer step, the ranks' models averaged and the change
#   given to an outer SGD with Nesterov momentum, checked for 3 outer steps against DiLoCo on one
#   process.

# %%
# %dist stop
