# %% [markdown]
# # 09 · Fault tolerance: checkpoint, crash, restart, resume
#
# A job on many devices fails more often than a job on one: if any of N devices can stop it, the
# job's mean time between failures is the device's divided by N. Long runs survive by
# **checkpointing** regularly and **resuming** from the last checkpoint after a failure, losing only
# the work done since.
#
# Two rules make a checkpoint trustworthy:
#
# * **one writer**: the replicas are identical, so rank 0 alone writes (every rank takes part, so
#   that nobody moves on before the file exists);
# * **atomic**: write to a temporary file, flush it to disk, then rename it onto the final name. A
#   rename is atomic, so a crash at any moment leaves the old checkpoint or the new one, never half
#   of one.
#
# `distlab.checkpoint.save` / `load` do both, and also keep the optimizer state, the sampler's epoch
# and every rank's random-number state, so that a resumed run continues **exactly** as if it had
# never stopped. This lab proves that on two ranks, with a real crash in the middle.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## A training loop that can resume
#
# The loop is defined once, in the notebook, and pushed to the ranks (after a restart the ranks are
# fresh processes, so it is pushed again). It looks for the latest checkpoint in its directory and,
# if there is one, loads it and skips the batches of the current epoch that were already done.
# Every `every` steps it saves. `crash_at` makes rank 1 die by `SIGKILL` at that step, the way a
# machine losing power would: no exception, no clean-up.

# %%
import os
import shutil
import tempfile
import torch
import distlab
from distlab import checkpoint, theory
from sklearn.datasets import load_digits

digits = load_digits()
work = tempfile.mkdtemp(prefix="distlab-09-")
REF, RUN = os.path.join(work, "reference"), os.path.join(work, "run")

def train(ckpt_dir, total_steps, every=10, crash_at=None):
    """Train to `total_steps` optimizer steps, resuming from the latest checkpoint in `ckpt_dir`."""
    import signal
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    rank = dist.get_rank()
    data = TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)   # momentum: state that must survive
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler, generator=torch.Generator())

    step, epoch, log = 0, 0, []
    last = checkpoint.latest(ckpt_dir)
    if last is not None:
        state = checkpoint.load(last, model=model, optimizer=opt, sampler=sampler)
        step, epoch = state["step"], state["epoch"]
        log.append(f"resumed from {last.name}: step {step}, epoch {epoch}")
    while step < total_steps:
        sampler.set_epoch(epoch)
        done_in_epoch = step - epoch * len(loader)       # batches of this epoch already trained on
        for i, (x, y) in enumerate(loader):
            if i < done_in_epoch:
                continue
            if crash_at == step and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)     # a hard failure, mid-epoch
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            distlab.log(loss=loss, epoch=epoch)
            if step % every == 0:
                checkpoint.save(checkpoint.path_for(ckpt_dir, step), model=model, optimizer=opt,
                                step=step, sampler=sampler)
                log.append(f"step {step} (epoch {epoch}): checkpoint saved")
            if step == total_steps:
                break
        else:
            epoch += 1
    return [p.detach().clone() for p in model.module.parameters()], log

lab = distlab.current_lab()
lab.push(train=train, REF=REF, RUN=RUN)

# %% [markdown]
# ## The run that never fails
#
# For comparison, 40 steps without interruption (an epoch is 29 batches of 32 per rank, so the run
# crosses into a second epoch). Its final weights are what the interrupted run must reproduce.

# %%
# %%ddp
reference, ref_log = train(REF, total_steps=40)
if rank == 0:
    print(*ref_log, sep="\n")

# %%
reference = lab.pull("reference", ranks=0)[0]      # kept in the notebook: rank memory does not survive

# %% [markdown]
# ## The run that crashes
#
# Same run in another directory, checkpointing every 10 steps; rank 1 dies at step 25. Rank 0 is
# then waiting in an all-reduce for a peer that no longer exists. distlab notices the dead engine,
# releases rank 0, and reports both:

# %% tags=["raises-exception"]
# %%ddp
weights, run_log = train(RUN, total_steps=40, crash_at=25)

# %% tags=["nbval-check-output"]
print([(row.rank, row.health) for row in lab.status()])
print("checkpoints on disk:", sorted(os.listdir(RUN)))

# %% [markdown]
# Rank 1 is dead and its memory is gone; rank 0 holds weights of step 25 that nobody can trust any
# more. What survives is on disk: the checkpoints of steps 10 and 20, each complete.
#
# `%dist restart` replaces the engines and builds a fresh process group of the same size. The ranks'
# namespaces are new, so the training function is pushed again.

# %%
# %dist restart
lab.push(train=train, REF=REF, RUN=RUN)

# %%
# %%ddp
weights, run_log = train(RUN, total_steps=40)
if rank == 0:
    print(*run_log, sep="\n")

# %% [markdown]
# The resumed run started at step 20 (5 steps of work, 20 to 25, were lost and redone) and finished
# at 40. Compare it with the run that never failed, bit for bit:

# %% tags=["nbval-check-output"]
weights = lab.pull("weights")
print("resumed run identical to the uninterrupted run:",
      all(torch.equal(a, b) for a, b in zip(weights[0], reference)))
print("replicas identical:", all(torch.equal(a, b) for a, b in zip(weights[0], weights[1])))
print("steps redone after the crash:", theory.lost_work_s(25, 10))

# %% [markdown]
# Identical, not merely close: same weights, same momentum buffers, same position in the same
# shuffled epoch. That is the standard a checkpoint should meet; "the loss curve looks similar" hides
# bugs such as a sampler that restarts its epoch or an optimizer that lost its state.
#
# ## Fault injection from the notebook: `%dist kill`
#
# `%dist kill 1` hard-kills rank 1 now, as a crash would. The next cell cannot run on a world with a
# dead rank, and says so:

# %%
# %dist kill 1

# %% tags=["raises-exception"]
# %%ddp
weights, run_log = train(RUN, total_steps=50)

# %% [markdown]
# Restart, push, and go on to step 50 from the checkpoint of step 40:

# %%
# %dist restart
lab.push(train=train, REF=REF, RUN=RUN)

# %%
# %%ddp
weights, run_log = train(RUN, total_steps=50)

# %% tags=["nbval-check-output"]
print(*lab.pull("run_log", ranks=0)[0], sep="\n")
print("checkpoints on disk:", sorted(os.listdir(RUN)))

# %% [markdown]
# ## Why the rename matters
#
# A writer killed halfway leaves a torn file. `checkpoint.save` writes to a hidden temporary file
# next to the target and renames it only when it is complete and flushed, so a torn file is never
# under a checkpoint's name, and `latest()` never returns one. Simulate a writer that died at step
# 60, then a careless writer that wrote straight onto the final name:

# %% tags=["nbval-check-output"]
good = checkpoint.latest(RUN)
blob = open(good, "rb").read()
with open(os.path.join(RUN, ".ckpt-00000060.pt.tmp-host-999999-dead"), "wb") as f:
    f.write(blob[: len(blob) // 2])                  # what a killed atomic writer leaves: hidden
print("latest checkpoint is still:", checkpoint.latest(RUN).name)

torn = os.path.join(RUN, "ckpt-00000070.pt")
with open(torn, "wb") as f:
    f.write(blob[: len(blob) // 2])                  # what a killed naive writer leaves
print("latest checkpoint now:", checkpoint.latest(RUN).name)
try:
    checkpoint.read(torn)
except checkpoint.CheckpointError as exc:
    print("loading it:", type(exc).__name__, "-", str(exc).split(":")[0].replace(RUN, "RUN"))

# %% [markdown]
# With a naive writer, the run would try to resume from a file that cannot be read (or worse, from
# one that reads but is incomplete; the digest `save` stores is what catches that case).
#
# ## How often to checkpoint
#
# Checkpointing costs time; not checkpointing costs the work since the last one. Young's rule
# balances them: interval = sqrt(2 x checkpoint cost x MTBF). A job on 1,000 devices that each fail
# on average once in 5 years fails about every 44 hours; with a 60 s checkpoint:

# %% tags=["nbval-check-output"]
mtbf = theory.cluster_mtbf_s(device_mtbf_s=5 * 365 * 86400, devices=1000)
print(f"job MTBF: {mtbf / 3600:.1f} hours")
print(f"checkpoint every {theory.optimal_checkpoint_interval_s(60, mtbf) / 60:.0f} minutes")

# %% [markdown]
# **Elastic training** goes one step further: instead of restarting the same world, the job continues
# with the workers that are left (or adds new ones), re-sharding the data for the new world size
# (`torchrun --nnodes=MIN:MAX` with a rendezvous backend does this in PyTorch). `checkpoint.load` is
# ready for it: it restores the model, optimizer and epoch at any world size.
#
# ## Practice

# %%
# %quiz fault-tolerance -n 4

# %%
shutil.rmtree(work)
# %dist stop
