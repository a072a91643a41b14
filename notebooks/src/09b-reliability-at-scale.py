# %% [markdown]
# # 09b · Reliability at scale: interruptions, NaNs, loss spikes and silent corruption
#
# Notebook 09 made a crash survivable: checkpoint, restart, resume, or heal in place. At the scale of
# the largest runs, crashes are only the loudest failures. The Llama 3 paper (Llama Team, AI @ Meta,
# 2024, section 3.3.4) reports a 54-day snapshot of pre-training on 16,384 H100 GPUs: **466 job
# interruptions**, 47 of them planned and **419 unexpected**, about 78% of those attributed to
# confirmed or suspected hardware problems, among them *silent data corruption*: a part that computes
# a wrong number without any error.
#
# This lab measures, on 4 ranks training one model with DDP, the three quieter failures a large run
# must watch for, and what it costs to catch each:
#
# 1. **A NaN.** One rank's batch holds a bad value; its gradients become NaN, and DDP's all-reduce
#    spreads them to every replica in one step.
# 2. **A loss spike.** One rank's batch is far off the distribution; the loss jumps, and one update
#    on it can undo many.
# 3. **Silent data corruption.** One bit of one weight flips on one rank. Nothing raises; DDP keeps
#    averaging gradients, but the replicas' weights are no longer the same, and they never become the
#    same again.
#
# Each is caught by a check that all ranks agree on, so that they all take the same decision.

# %%
# %load_ext distlab
# %dist start -n 4

# %%
import distlab
from distlab import theory
from distlab.quiz import predict

lab = distlab.current_lab()

# %% [markdown]
# ## How often, at 16,384 GPUs
#
# **Predict first**: 419 unexpected interruptions in 54 days. On average, how many hours did the run go
# between two of them?

# %%
DAY, HOUR = 86400, 3600


def hours_between(interruptions=419, days=54):
    return days * DAY / interruptions


mtbf_guess = predict("Llama 3's pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs. How many hours "
                     "between two, on average?", theory=hours_between, unit="h", tolerance=0.1)
mtbf_guess

# %%
job_mtbf_s = hours_between()
gpu_mtbf_s = job_mtbf_s * 16384                  # the GPU's MTBF, were every interruption one GPU's (independent)
print(f"the job: one unexpected interruption every {job_mtbf_s / HOUR:.1f} hours")
print(f"as one part of 16,384 that each stop the job: a part's mean time between failures "
      f"{gpu_mtbf_s / (365 * DAY):.1f} years (theory.cluster_mtbf_s gives back "
      f"{theory.cluster_mtbf_s(gpu_mtbf_s, 16384) / HOUR:.1f} h)")
print(f"Young's checkpoint interval at that MTBF, for a checkpoint that stops training 60 s: "
      f"{theory.optimal_checkpoint_interval_s(60, job_mtbf_s) / 60:.0f} minutes")
mtbf_guess.reveal(job_mtbf_s)

# %% [markdown]
# A part that fails once in six years is a reliable part; 16,384 of them stop the job every three
# hours. The paper kept more than 90% of the time training through this, with automation that
# restarted the job and checkpoints fast enough to be frequent (asynchronous ones write in the
# background: notebook 21). The rest of this lab is the failures that stop nothing.
#
# ## The run, and a fault-free reference
#
# 4 ranks train a small regression model with DDP for 120 steps, each rank on its own batches. Every
# step, `train` can check three things before it takes the step, each with one collective that every
# rank joins, so that every rank decides the same:
#
# - `finite`: is this rank's loss a finite number? An all-reduce (MIN) of one 0/1 flag a rank.
# - `spike`: is this rank's loss more than 10 times the median of its last 20 steps'? (A median, not
#   a mean and a spread: late in training the losses are small and close together, and ordinary
#   batch-to-batch noise is many of their standard deviations.) The same all-reduce carries it.
# - `checksum`: every 10 steps, the sum of the weights in float64, all-gathered: the replicas must
#   hold the same weights, so the sums must be equal to the last bit.
#
# A step that a check refuses is skipped on every rank (no backward, no update). `faults` says what
# goes wrong at which step.

# %%
# %%ddp
import statistics
import time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
STEPS = 120


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 1)).to(device)


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(faults=None, guard=False, checksum_every=0):
    """STEPS steps of DDP; faults: {"nan": step, "spike": step, "flip": step} on rank 1, 2 and 3."""
    faults = faults or {}
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    teacher = torch.randn(32, 1, generator=torch.Generator().manual_seed(7)).to(device)
    losses, skipped, found, spent = [], [], None, 0.0
    start = time.perf_counter()
    for step in range(1, STEPS + 1):
        x = torch.randn(64, 32, generator=g).to(device)
        y = x @ teacher
        if faults.get("nan") == step and rank == 1:
            x[0, 0] = float("nan")                          # a corrupt value in rank 1's batch
        if faults.get("spike") == step and rank == 2:
            y = 50 * y                                      # rank 2's batch far off the distribution
        if faults.get("flip") == step and rank == 3:
            with torch.no_grad():                           # one bit of one weight flips: an SDC
                w = model.module[0].weight.view(-1).view(torch.int32)
                w[100] ^= 1 << 27
        loss = nn.functional.mse_loss(model(x), y)
        t0 = time.perf_counter()
        if guard:
            spike = len(losses) >= 20 and loss.item() > 10 * statistics.median(losses[-20:])
            ok = torch.tensor([float(torch.isfinite(loss).item() and not spike)], device=device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)       # every rank takes the same decision
            if ok.item() < 1:
                skipped.append(step)
                spent += time.perf_counter() - t0
                continue
        if checksum_every and step % checksum_every == 0 and found is None:
            sums = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world_size)]
            dist.all_gather(sums, weights(model.module).double().sum().reshape(1))
            if len({s.item() for s in sums}) > 1:
                found = [step, [r for r, s in enumerate(sums) if s.item() != sums[0].item()] or [0]]
        spent += time.perf_counter() - t0
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    mine = weights(model.module)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return {"nan ranks": sum(int(not torch.isfinite(w).all()) for w in everyone),
            "replicas equal": all(torch.equal(w, everyone[0]) for w in everyone),
            "last loss": losses[-1], "skipped": skipped, "found": found, "checks s": spent,
            "run s": time.perf_counter() - start}


clean = train()

# %% [markdown]
# ## 1. A NaN in one rank's batch
#
# At step 30 one value of rank 1's batch is NaN. Its loss is NaN, so are its gradients, and DDP
# all-reduces the gradients of every rank in the backward.
#
# **Predict first**: without a guard, after that step, how many of the 4 ranks hold NaN weights?

# %%
nan_guess = predict("One value of rank 1's batch is NaN at step 30; DDP, no check. After that step, how many of the "
                    "4 ranks hold NaN weights?",
                    choices={"1": "1: only rank 1", "4": "all 4", "0": "none: DDP drops the bad gradients"},
                    answer="4")
nan_guess

# %%
# %%ddp
nan_unguarded = train({"nan": 30})
nan_guarded = train({"nan": 30}, guard=True)

# %%
runs = {name: lab.pull(name, 0)[0] for name in ("clean", "nan_unguarded", "nan_guarded")}
for name, r in runs.items():
    print(f"{name:<14} ranks with NaN weights: {r['nan ranks']}, replicas equal: {r['replicas equal']}, "
          f"steps skipped: {r['skipped']}, last loss {r['last loss']:.4f}")
nan_guess.reveal(str(runs["nan_unguarded"]["nan ranks"]))

# %% tags=["nbval-check-output"]
print("unguarded: one rank's NaN reached every rank's weights:", runs["nan_unguarded"]["nan ranks"] == 4)
print("guarded: step 30 skipped on every rank, the weights finite and equal:",
      runs["nan_guarded"]["skipped"] == [30] and runs["nan_guarded"]["nan ranks"] == 0
      and runs["nan_guarded"]["replicas equal"])

# %% [markdown]
# The all-reduce that makes the replicas agree is also what spreads the NaN: an average with one NaN
# in it is NaN, on every rank at once. The guard costs one all-reduce of one number a step, and it
# must come before the backward (whose all-reduce would spread the NaN) and be decided by every rank
# together: a rank that skipped alone would leave the others waiting in the backward's all-reduce.
#
# ## 2. A loss spike
#
# At step 60, rank 2's targets are 50 times too large: its loss is about 2,500 times its usual. It is
# finite, so the first check passes; the second compares it with the last 20 steps.

# %%
# %%ddp
spike_unguarded = train({"spike": 60})
spike_guarded = train({"spike": 60}, guard=True)

# %%
runs.update({name: lab.pull(name, 0)[0] for name in ("spike_unguarded", "spike_guarded")})
for name in ("clean", "spike_unguarded", "spike_guarded"):
    r = runs[name]
    print(f"{name:<16} steps skipped: {r['skipped']}, last loss {r['last loss']:.5f}")

# %% tags=["nbval-check-output"]
print("guarded: the spike's step, and only it, skipped on every rank:", runs["spike_guarded"]["skipped"] == [60])
print("unguarded, the run ends above the clean run's loss; guarded, within 10% of it:",
      runs["spike_unguarded"]["last loss"] > runs["clean"]["last loss"]
      and abs(runs["spike_guarded"]["last loss"] / runs["clean"]["last loss"] - 1) < 0.1)

# %% [markdown]
# One step on a batch 50 times off threw the model so far that the 60 steps after it did not bring
# the loss back: it ended thousands of times the clean run's. Large runs watch for this and skip or roll back: the paper
# on OPT-175B (Zhang et al. 2022) describes restarting from an earlier checkpoint with a lower
# learning rate after loss spikes, and a check like this one skips the batch before it does harm.
#
# ## 3. One flipped bit
#
# At the start of step 40, on rank 3 only, bit 27 of one weight of the first layer flips (it
# multiplies that weight by 2^16 or divides it by 2^16: the bit sits in the exponent). Every rank
# goes on: no error, no NaN. The checksum of the weights, compared across ranks every 10 steps, is
# what sees it.

# %%
# %%ddp
flip_unchecked = train({"flip": 40})
flip_checked = train({"flip": 40}, checksum_every=10)
none_checked = train(checksum_every=10)

# %%
runs.update({name: lab.pull(name, 0)[0] for name in ("flip_unchecked", "flip_checked", "none_checked")})
for name in ("flip_unchecked", "flip_checked", "none_checked"):
    r = runs[name]
    print(f"{name:<15} ranks with NaN weights: {r['nan ranks']}, replicas equal at the end: {r['replicas equal']}, "
          f"found (step, ranks that differ from rank 0): {r['found']}")
for name, what in (("nan_guarded", "the guard, every step"), ("none_checked", "the checksums, every 10 steps")):
    r = runs[name]
    print(f"{what}: {1e3 * r['checks s']:.0f} ms of the run's {1e3 * r['run s']:.0f} ms on rank 0 "
          f"({r['checks s'] / r['run s']:.0%})")

# %% tags=["nbval-check-output"]
print("the flip raised nothing and left every weight finite:", runs["flip_unchecked"]["nan ranks"] == 0)
print("the replicas stayed different to the end:", not runs["flip_unchecked"]["replicas equal"])
print("the checksum found it at step 40's comparison, made after the flip, on rank 3 alone:",
      runs["flip_checked"]["found"] == [40, [3]])
print("without a flip, the checksums found nothing:", runs["none_checked"]["found"] is None)

# %% [markdown]
# What the checks cost here: the guard is one all-reduce of one number a step, a few milliseconds of
# latency on these CPU ranks, about a quarter of this tiny model's step; on a real
# model's step of seconds it is noise, and it can ride on an all-reduce the step makes anyway (the
# loss's, for the logs). (`loss.item()` also waits for the GPU's queue to drain, which is why large
# runs check on a tensor and read it late.) The checksum, one all-gather every 10 steps, cost a
# twentieth.
#
# DDP all-reduces gradients, not weights: it trusts the replicas to start equal and to apply equal
# updates. After the flip, rank 3 applies the same averaged updates to a different weight, and
# nothing ever brings it back. A checksum of the weights across the replicas costs one all-gather
# of one number per check; what to do when it differs is a policy (here nothing; a real run would
# restore the odd replica from a peer, as healing does in notebook 09, or go back to a checkpoint).
# Corruption inside a computation, which changes a gradient once, is harder: it leaves every
# replica equal and wrong. Checks like these catch what makes replicas disagree or numbers blow up,
# not that. And a sum is a weak fingerprint: it sees one flipped bit, but not two weights swapped.
#
# ## Practice

# %%
# %quiz fault-tolerance -n 2 --seed 9

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise diverged-replicas`: name the parameters whose replicas differ across the ranks, with a
#   fingerprint of a few bytes a parameter that sees every bit and where it is (a swap too), the
#   same answer on every rank.

# %%
# %dist stop
