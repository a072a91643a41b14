# %% [markdown]
# # 21 · Uneven inputs and distributed checkpoints
#
# Two things every real training run meets sooner or later, each on live ranks:
#
# 1. **Uneven inputs.** A rank with fewer batches than the others leaves the loop early, and the
#    others wait in the next all-reduce forever. DDP's `join()` (torch's `Join` context manager)
#    lets them finish.
# 2. **Distributed checkpoints.** `torch.distributed.checkpoint` (DCP) has every rank write its own
#    shards, plus one metadata file. We save an FSDP2 model and its AdamW state from 4 ranks, also
#    in the background (`async_save`), and load both on 2, resharded on the way, bit for bit.
#
# Averaging the models less often (local SGD, DiLoCo) is notebook [21b](21b-local-sgd-diloco.ipynb).

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
# An FSDP2 model's `state_dict()` holds each rank's shard of every parameter, as DTensors, and so does
# its optimizer's: AdamW keeps two tensors the size of each parameter (`exp_avg`, `exp_avg_sq`, the
# running means of the gradient and of its square) and a step count. `get_state_dict(model, opt)`
# (`torch.distributed.checkpoint.state_dict`) gives both, keyed by the parameters' names, so that the
# optimizer's state can be loaded into a model sharded another way. `torch.distributed.checkpoint.save`
# has each rank write its shards to its own file, and the coordinator (rank 0) write the metadata that
# says where every piece of every tensor is. Nothing is gathered on one rank. `torch.save` of a
# gathered state dict is the one-file alternative, and it needs the whole model on the rank that writes.
#
# The model has 4 linear layers of 256 x 256 (with their biases), in float32. We train it with AdamW
# for 2 steps on 4 ranks and save the model and the optimizer with DCP. We also keep them whole,
# gathered, to compare with later.
#
# **Predict first**: how many bytes of tensors will each rank's file hold?

# %%
import os
import shutil
import tempfile

from distlab.quiz import predict

folder = tempfile.mkdtemp(prefix="distlab-dcp-")
lab.push(folder=folder)
model_bytes = 4 * (256 * 256 + 256) * 4                  # 4 layers' weights and biases, 4 bytes each


def per_rank_bytes():
    """A quarter of the model, and AdamW's two tensors of the same size: 3 x the model over 4 ranks."""
    return 3 * model_bytes / 4


guess = predict("4 ranks save an FSDP2 model of 4 x (256 x 256 + 256) float32 parameters and its AdamW state "
                "with DCP: how many bytes of tensors does each rank's file hold?",
                theory=per_rank_bytes, unit="KB", tolerance=0.1)
guess

# %%
# %%ddp
import os
import time
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


def fsdp_model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def whole(model_sd, optim_sd):
    """Every tensor of both state dicts, gathered whole (for the checks only)."""
    out = {f"model {name}": p.full_tensor().clone() for name, p in model_sd.items()}
    for name, state in optim_sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key} {name}"] = state[key].full_tensor().clone()
    return out


model, opt = fsdp_model_and_opt()
g = torch.Generator().manual_seed(rank)
for _ in range(2):
    x = torch.randn(32, 256, generator=g).to(device)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
model_sd, optim_sd = get_state_dict(model, opt)
state = {"model": model_sd, "optim": optim_sd}
saved = whole(model_sd, optim_sd)
dcp.save(state, checkpoint_id=os.path.join(folder, "step-2"))
local_shard_bytes = sum(t.to_local().numel() * t.element_size()
                        for t in [*model_sd.values(), *(s[k] for s in optim_sd["state"].values()
                                                       for k in ("exp_avg", "exp_avg_sq"))])
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
print("each rank's shards of the model and its AdamW state:", ", ".join(f"rank {r} {b:,}" for r, b in shards.items()),
      "bytes")
print(f"torch.save of the gathered state: one file of {full_bytes:,} bytes, written by rank 0 alone")

# %%
guess.reveal(shards[0])

# %% tags=["nbval-check-output"]
data_files = {name: size for name, size in files.items() if name.endswith(".distcp")}
print("one data file per rank, and one metadata file:", len(data_files) == 4 and ".metadata" in files)
print("each rank holds 3 x a quarter of the model:", all(b == 3 * model_bytes // 4 for b in shards.values()))
print("each rank's file holds its shards (within 10% of them):",
      all(0.9 * shards[r] <= size <= 1.1 * shards[r] + 4096 for r, size in zip(range(4), data_files.values())))

# %% [markdown]
# Each rank wrote a quarter of the model and of its AdamW state: three times a quarter of the model's
# bytes, with the step counts and the metadata file small beside them.
#
# ## Saving in the background
#
# `dcp.save` returns when the files are written: the training loop waits for the disk. `dcp.async_save`
# first copies the state to CPU memory it owns (on a GPU, out of the GPU's memory), then returns a
# future and writes from a thread, so training goes on while the bytes reach the disk (torch's
# `torch.distributed.checkpoint.async_save` documentation). Here the tensors are already in CPU
# memory, and the copy is what the call waits for.

# %%
# %%ddp
t0 = time.perf_counter()
written = dcp.async_save(state, checkpoint_id=os.path.join(folder, "step-2-async"))
returned_s = time.perf_counter() - t0
written.result()                                         # the write, finished
async_times = {"returned (ms)": 1e3 * returned_s, "written (ms)": 1e3 * (time.perf_counter() - t0)}

# %%
for r, times in lab.pull("async_times").items():
    print(f"rank {r}: async_save returned after {times['returned (ms)']:.0f} ms, the write was done after "
          f"{times['written (ms)']:.0f} ms")

# %% [markdown]
# The call returned before the write was done; between the two a training loop would have gone on. Both
# checkpoints are loaded below, and must hold the same tensors.
#
# Now a world of 2 ranks, as after a job lost half its nodes (`%dist restart -n 2`). The model is built
# again with FSDP2 on 2 ranks, so each shard is half of every parameter now, not a quarter, and so is
# each of AdamW's tensors. `dcp.load` reads into those shards in place: each rank reads the pieces of
# the files that its new shards cover, and `set_state_dict` puts them into the model and the optimizer.

# %%
# %dist restart -n 2

# %%
lab.push(folder=folder)

# %%
# %%ddp
import os
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


def loaded_from(checkpoint):
    torch.manual_seed(1)                                 # different weights: the load must overwrite them
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model_sd, optim_sd = get_state_dict(model, opt)      # the shapes to read into, AdamW's state made
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(folder, checkpoint))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, opt)      # read back out of the model and the optimizer
    return model, {f"model {name}": p.full_tensor() for name, p in model_sd.items()} | {
        f"{key} {name}": s[key].full_tensor() for name, s in optim_sd["state"].items() for key in ("exp_avg", "exp_avg_sq")}


saved = torch.load(os.path.join(folder, "gathered.pt"))
model, loaded = loaded_from("step-2")
_, loaded_async = loaded_from("step-2-async")
resharded = {"world": world_size, "shard rows": model[0].weight.to_local().shape[0], "tensors": len(saved),
             "bit for bit": all(torch.equal(loaded[name], saved[name]) for name in saved),
             "async the same": all(torch.equal(loaded_async[name], saved[name]) for name in saved)}

# %% tags=["nbval-check-output"]
resharded = lab.pull("resharded")
print(resharded)
print("loaded at 2 ranks, the model and AdamW's state bit for bit as saved at 4:",
      all(r["bit for bit"] and r["tensors"] == 24 for r in resharded.values()))
print("the checkpoint written in the background holds the same:", all(r["async the same"] for r in resharded.values()))

# %%
shutil.rmtree(folder)

# %% [markdown]
# The checkpoint written by 4 ranks loaded on 2, each rank now holding 128 of a layer's 256 rows
# where it held 64, and AdamW's running means resharded with them: training goes on where it
# stopped, not with an optimizer that starts again. This is what an elastic job needs (notebook 09
# resumes a whole-model checkpoint at another size).
#
# ## Practice

# %%
# %quiz fault-tolerance -n 2 --seed 21

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise atomic-checkpoint`: a save that survives a SIGKILL, DCP's promise for one file: the grader
#   kills your writer mid-write again and again, then loads what is left, which must be one whole
#   checkpoint.

# %%
# %dist stop
