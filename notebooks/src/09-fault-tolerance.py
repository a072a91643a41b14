# %% [markdown]
# # 09 · Fault tolerance: checkpoint, crash, restart, resume
#
# A job on many devices fails more often than a job on one: if any of N devices can stop it, the
# job's mean time between failures is the device's divided by N (for independent failures). Long
# runs survive by **checkpointing** regularly and **resuming** from the last checkpoint after a
# failure, losing only the work done since.
#
# Two rules make a checkpoint trustworthy:
#
# * **one writer**: the replicas are identical, so rank 0 alone writes (every rank takes part, so
#   that nobody moves on before the file exists);
# * **atomic**: write to a temporary file in the same directory, flush it to disk, then rename it
#   onto the final name. On a local POSIX file system a rename within one file system is atomic
#   (POSIX `rename()`), so a crash at any moment leaves the old checkpoint or the new one, never half
#   of one. Network file systems and object stores may not promise it: check yours before relying on it.
#
# `distlab.checkpoint.save` / `load` do both, and also keep the optimizer state, the sampler's epoch
# and every rank's random-number state, so that a resumed run continues **exactly** as if it had
# never stopped. This lab proves that on two ranks, with a real crash in the middle, then resumes the
# same checkpoint on three ranks, as an elastic job would. Its last two sections heal instead of
# restarting: the others go on, and a new rank takes a live peer's state, first after a crash, then
# after a node is cut off from the network.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## A training loop that can resume
#
# The loop is defined once, in the notebook, and pushed to the ranks (after a restart the ranks are
# fresh processes, so it is pushed again). It looks for the latest checkpoint in its directory and,
# if there is one, loads it and skips the batches of the current epoch that were already done (a
# count it saves with each checkpoint, as `extra`; at another world size it starts the epoch over,
# as the elastic section explains). Every `every` steps it saves. `crash_at` makes rank 1 die by `SIGKILL` at that step, the way a
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

def train(ckpt_dir, total_steps, device, every=10, crash_at=None):
    """Train to `total_steps` optimizer steps on `device`, resuming from the latest checkpoint in `ckpt_dir`.

    Returns the final weights, the weights the run started from (after loading a checkpoint), a log,
    the step it started from, the batches of an epoch per rank, and the seconds a step took here.
    `device` is the cell's: a function pushed from the notebook does not see the rank's names.
    """
    import signal
    import time
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    rank, world = dist.get_rank(), dist.get_world_size()
    # The data set stays on the CPU, where the DataLoader reads it; each batch goes to `device`.
    data = TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)   # momentum: state that must survive
    sampler = DistributedSampler(data, shuffle=True, seed=0)           # this rank's share of this world
    loader = DataLoader(data, batch_size=32, sampler=sampler, generator=torch.Generator())

    step, epoch, done_in_epoch, log = 0, 0, 0, []
    last = checkpoint.latest(ckpt_dir)
    if last is not None:
        state = checkpoint.load(last, model=model, optimizer=opt, sampler=sampler)
        step, epoch = state["step"], state["epoch"]
        if state["world_size"] == world:
            done_in_epoch = state["extra"]["done_in_epoch"]   # batches of this epoch already trained on
        # at another world size the epoch is cut into other batches: it starts over (done_in_epoch 0)
        log.append(f"resumed from {last.name}: step {step}, epoch {epoch}, saved by {state['world_size']} "
                   f"ranks, {world} now; RNG state {state['rng']}")
    first_step, start = step, [p.detach().cpu().clone() for p in model.module.parameters()]   # CPU: for the notebook
    began = time.perf_counter()
    while step < total_steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < done_in_epoch:
                continue
            if crash_at == step and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)     # a hard failure, mid-epoch
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            distlab.log(loss=loss, epoch=epoch)
            if step % every == 0:
                checkpoint.save(checkpoint.path_for(ckpt_dir, step), model=model, optimizer=opt,
                                step=step, sampler=sampler, extra={"done_in_epoch": i + 1})
                log.append(f"step {step} (epoch {epoch}): checkpoint saved")
            if step == total_steps:
                break
        else:
            epoch, done_in_epoch = epoch + 1, 0
    return {"weights": [p.detach().cpu().clone() for p in model.module.parameters()], "start": start, "log": log,
            "first_step": first_step, "batches_per_epoch": len(loader),
            "s_per_step": (time.perf_counter() - began) / max(1, step - first_step)}

lab = distlab.current_lab()
lab.push(train=train, REF=REF, RUN=RUN)

# %% [markdown]
# ## The run that never fails
#
# For comparison, 40 steps without interruption (an epoch is 29 batches of 32 per rank, so the run
# crosses into a second epoch). Its final weights are what the interrupted run must reproduce.

# %%
# %%ddp
ref = train(REF, total_steps=40, device=device)
if rank == 0:
    print(*ref["log"], sep="\n")

# %%
ref = lab.pull("ref", ranks=0)[0]         # kept in the notebook: rank memory does not survive a crash
reference = ref["weights"]

# %% [markdown]
# ## The run that crashes
#
# Same run in another directory, checkpointing every 10 steps; rank 1 dies at step 25. Rank 0 is
# then waiting in an all-reduce for a peer that no longer exists. distlab notices the dead engine,
# releases rank 0, and reports both.
#
# **Predict first**: the run will resume from its last checkpoint. How many steps will it do twice?

# %%
from distlab.quiz import predict

redone_q = predict("Rank 1 dies at step 25 of a run that checkpoints every 10 steps. How many steps will the "
                   "resumed run do a second time?", theory="lost_work_s", tolerance=0.01,
                   elapsed_s=25, checkpoint_interval_s=10)          # the formula counts steps as well as seconds
redone_q

# %% tags=["raises-exception"]
# %%ddp
run = train(RUN, total_steps=40, device=device, crash_at=25)

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
run = train(RUN, total_steps=40, device=device)
if rank == 0:
    print(*run["log"], sep="\n")

# %% [markdown]
# The resumed run started at step 20 and finished at 40. Compare it with the run that never failed,
# bit for bit:

# %% tags=["nbval-check-output"]
run = lab.pull("run")
print("resumed run identical to the uninterrupted run:",
      all(torch.equal(a, b) for a, b in zip(run[0]["weights"], reference)))
print("replicas identical:", all(torch.equal(a, b) for a, b in zip(run[0]["weights"], run[1]["weights"])))

# %% [markdown]
# Identical, not merely close. Equal weights after 20 more steps also vouch for what is not compared
# here: with the momentum buffers lost, or a sampler that restarted its epoch, the same 20 steps would
# have ended elsewhere. That is the standard a checkpoint should meet; "the loss curve looks similar"
# hides exactly such bugs.
#
# What the crash cost is the work since the last checkpoint: steps 20 to 25, done twice.
# `theory.lost_work_s(elapsed_s, checkpoint_interval_s)` counts it in seconds: the time since the start
# modulo the checkpoint interval. At the pace a step took here (checkpoints included, measured in the
# run that never failed):

# %%
step_s = ref["s_per_step"]
lost_s = theory.lost_work_s(elapsed_s=25 * step_s, checkpoint_interval_s=10 * step_s)
print(f"a step took {step_s * 1e3:.1f} ms; the crash 25 steps in, with a checkpoint every 10, lost {lost_s * 1e3:.0f} ms")

redone_q.reveal(25 - run[0]["first_step"])

# %% tags=["nbval-check-output"]
print("steps redone (crash step - step resumed from):", 25 - run[0]["first_step"])
print("theory.lost_work_s, counted in steps:", round(lost_s / step_s))

# %% [markdown]
# ## Fault injection from the notebook: `%dist kill`
#
# `%dist kill 1` hard-kills rank 1 now, as a crash would. The next cell cannot run on a world with a
# dead rank, and says so:

# %%
# %dist kill 1

# %% tags=["raises-exception"]
# %%ddp
run = train(RUN, total_steps=50, device=device)

# %% [markdown]
# Restart, push, and go on to step 50 from the checkpoint of step 40:

# %%
# %dist restart
lab.push(train=train, REF=REF, RUN=RUN)

# %%
# %%ddp
run = train(RUN, total_steps=50, device=device)

# %% tags=["nbval-check-output"]
print(*lab.pull("run", ranks=0)[0]["log"], sep="\n")
print("checkpoints on disk:", sorted(os.listdir(RUN)))

# %% [markdown]
# ## Elastic training: resume at another world size
#
# `torchrun` can run a job elastically (`torchrun --nnodes=MIN:MAX` with a rendezvous backend). When a
# node leaves or joins, its agent does not carry on with the workers that are left: it **stops every
# worker and starts all of them again** in a group of the new size, with new `RANK`s and `WORLD_SIZE`,
# and the script resumes from its last checkpoint (PyTorch docs, "torchrun (Elastic Launch)" and
# "Elastic Agent": "reacts to membership changes and restarts workers with the new members"). Nothing
# survives in memory; what the new world knows is what the checkpoint holds.
#
# Do the same here: the last checkpoint was written by 2 ranks at step 50. `%dist restart -n 3` stops
# both ranks and starts 3 fresh ones, and the same `train` resumes from that checkpoint and goes on to
# step 60. DDP's weights and optimizer state are the same on every rank, so one file serves any world
# size: every rank of the new world loads it. What changes with the size:
#
# * **the data each rank gets**: `DistributedSampler` cuts each epoch's shuffled order into 3 shares
#   instead of 2, so an epoch is fewer batches per rank, and a position inside an epoch saved at 2
#   ranks means nothing at 3: `train` starts the interrupted epoch over (the checkpoint of step 50 was
#   21 batches into epoch 1, and those samples are seen again). Elastic jobs therefore checkpoint at
#   epoch ends, or save how many samples of the epoch were consumed;
# * **the global batch**: 32 per rank x 3 ranks = 96 instead of 64, unless the per-rank batch changes;
# * **the learning rate rule**: the linear scaling rule (Goyal et al., 2017, "Accurate, Large Minibatch
#   SGD") would scale the rate with the global batch, x 1.5 here; `train` keeps lr = 0.05, so the
#   resumed run is a different run from here on, not the continuation 2 ranks would have made;
# * **random state**: ranks 0 and 1 get their own RNG states back; rank 2 had none, and `checkpoint.load`
#   seeds it from (step, rank), the same way every time.

# %%
# %dist restart -n 3
lab.push(train=train, REF=REF, RUN=RUN)

# %%
# %%ddp
elastic = train(RUN, total_steps=60, device=device)
print(*elastic["log"][:1], sep="\n")

# %% tags=["nbval-check-output"]
elastic = lab.pull("elastic")
saved = checkpoint.read(os.path.join(RUN, "ckpt-00000050.pt"))
print("world size now:", lab.world_size, "| saved by:", saved["world_size"], "ranks at step", saved["step"])
print("every rank resumed from step 50:", all(e["first_step"] == 50 for e in elastic.values()))
print("every rank started from the checkpoint's weights:",
      all(torch.equal(w, saved["model"][k]) for e in elastic.values() for w, k in zip(e["start"], saved["model"])))
print("batches per epoch per rank: 2 ranks", run[0]["batches_per_epoch"], "-> 3 ranks",
      elastic[0]["batches_per_epoch"])
print("global batch: 2 ranks", 32 * 2, "-> 3 ranks", 32 * lab.world_size)
print("replicas identical at step 60:",
      all(torch.equal(a, b) for e in elastic.values() for a, b in zip(e["weights"], elastic[0]["weights"])))

# %% [markdown]
# ## Why the rename matters
#
# A writer killed halfway leaves a torn file. `checkpoint.save` writes to a hidden temporary file
# next to the target and renames it only when it is complete and flushed, so a torn file is never
# under a checkpoint's name, and `latest()` never returns one. Simulate a writer that died at step
# 70, then a careless writer that wrote straight onto the final name:

# %% tags=["nbval-check-output"]
good = checkpoint.latest(RUN)
blob = open(good, "rb").read()
with open(os.path.join(RUN, ".ckpt-00000070.pt.tmp-host-999999-dead"), "wb") as f:
    f.write(blob[: len(blob) // 2])                  # what a killed atomic writer leaves: hidden
print("latest checkpoint is still:", checkpoint.latest(RUN).name)

torn = os.path.join(RUN, "ckpt-00000080.pt")
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
# (Young, 1974, "A first order approximation to the optimum checkpoint interval") balances them:
# interval = sqrt(2 x checkpoint cost x MTBF). A job on 1,000 devices that each fail
# on average once in 5 years fails about every 44 hours; with a 60 s checkpoint:

# %% tags=["nbval-check-output"]
mtbf = theory.cluster_mtbf_s(device_mtbf_s=5 * 365 * 86400, devices=1000)
print(f"job MTBF: {mtbf / 3600:.1f} hours")
print(f"checkpoint every {theory.optimal_checkpoint_interval_s(60, mtbf) / 60:.0f} minutes")

# %% [markdown]
# ## Healing instead of restarting: a quorum every step
#
# Everything above is torchelastic's model: one failure stops every rank, and the work since the last
# checkpoint is done again. Fault tolerance per step is the newer answer (torchft, which torchtitan
# uses): every step, the replicas alive form a *quorum* through a small server, the lighthouse;
# gradients are averaged over that quorum only, and a step commits only if every member's exchange
# succeeded. When a replica dies, the others' next step forms without it once the lighthouse has missed
# its heartbeats (1 s here), and a new replica joins a later quorum, which sends it a live peer's model
# and optimizer state before its first step (torchft's README and `Manager` docs).
#
# `%dist start -n 3 --heal` starts 3 ranks and torchft's lighthouse. In the cell,
# `model, opt = distlab.heal(model, opt)` wraps the model and optimizer; the loop after it is an
# ordinary one. Rank 1 crashes after step 40 of 150, and the lab puts a new process in its place,
# which runs the cell from its top.
#
# **Predict** before you run: how many steps do ranks 0 and 2 lose? How long before they commit one
# again? Does the new rank 1 end with the same weights as the others?

# %%
# %dist stop
# %dist start -n 3 --heal
lab = distlab.current_lab()
DIED = os.path.join(work, "died")
lab.push(DIED=DIED)

# %%
# %%ddp
import os, signal, time
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = distlab.heal(model, opt)
manager = distlab.rank.heal.current().manager
committed = []  # (step, time) of every step this rank committed
g = torch.Generator(device=device).manual_seed(100 + rank)
for step in range(150):
    opt.zero_grad()
    model(torch.randn(32, 64, generator=g, device=device)).square().mean().backward()
    opt.step()
    committed.append((manager.current_step(), time.time()))
    if rank == 1 and manager.current_step() == 40 and not os.path.exists(DIED):
        with open(DIED, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: no exception, no exit handlers
    time.sleep(0.05)

# %% [markdown]
# (Each rank's warning about `find_unused_parameters` is torchft's choice, not a mistake in the cell:
# its DDP asks for it so that DDP never regroups the gradient buckets after the first step, which a
# replica that joins later would not have done.)
#
# What each rank committed, and when; and every rank's weights, compared bit for bit:

# %% tags=["nbval-check-output"]
with open(DIED) as f:
    died = float(f.read())
kept = lab.run("committed", stream=False)
digest = "import hashlib; hashlib.sha256(b''.join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()"
weights = lab.run(digest, stream=False)
survivor = kept[0]
print("steps ranks 0 and 2 lost:", 150 - survivor[-1][0])
print("every rank ended at step 150:", {r: c[-1][0] for r, c in kept.items()} == {0: 150, 1: 150, 2: 150})
print("the new rank 1 began at a step past the crash:", kept[1][0][0] > 40)
print("every replica's weights bit-identical:", len(set(weights.values())) == 1)

# %% [markdown]
# The price of healing is the wait for the lighthouse to give up on the dead rank: its heartbeat
# timeout, 1 s. With a restart from a checkpoint every 25 steps instead, a crash after step 40 redoes
# the steps since step 25 (`theory.lost_work_s`), on top of restarting every rank. At this lab's steps of
# a few tens of milliseconds the two are of a size; at real steps of seconds the wait is under a step,
# while what a restart redoes grows with the checkpoint interval and the restart with the job's size:

# %%
step_s = (survivor[39][1] - survivor[9][1]) / 30
waited = next(t for s, t in survivor if s > 40) - died  # the first step committed without rank 1
print(f"healing: {150 - survivor[-1][0]} steps redone; the survivors waited {waited:.1f} s ({waited / step_s:.0f} steps' time) "
      f"for their next step; the new rank 1 joined {kept[1][0][1] - died:.1f} s after the crash")
redo_s = theory.lost_work_s(40 * step_s, 25 * step_s)
print(f"restart from a checkpoint every 25 steps: {redo_s / step_s:.0f} steps redone ({redo_s:.1f} s), "
      "plus a restart of every rank")

# %% [markdown]
# ## A node that drops off the network
#
# A crash is the kind failure: the process is gone, its connections reset, and its peers hear of it at
# once. A machine whose network link goes down is worse. Its processes are alive and still think they
# are in the job; the others hear only silence. The quorum treats silence as death: the lighthouse
# misses the node's heartbeats and forms the next quorums without it, as it did for the crash. What
# must not happen is the node's old processes acting on what they hold once the link returns: they
# missed steps and hold stale weights. Keeping a member the others gave up on from acting as if it
# were still in is called **fencing**, and it is done in two ways (Kleppmann 2016, "How to do
# distributed locking"). One makes sure the member is dead before anything takes its place (in
# clusters, STONITH: "shoot the other node in the head"). The other numbers every membership (an
# epoch, a *fencing token*) and refuses any action that carries a stale number. torchft has the
# second built in: each quorum has an id under which the process group is rebuilt, and a replica
# that joins a quorum behind its highest step heals from a peer before it steps, so a node whose
# link came back would be told at its next quorum that it is behind. Here the fence is the first
# kind, part of the fault, as a cluster's health check would do it: right after node 2's link goes
# down, its rank is killed. Its death crosses no link, so nothing resets the others' connections: they hear
# only silence. The lab then brings the link back and starts a new rank on the node, which heals from
# a live peer like the crashed rank did.
#
# Links need nodes: this lab runs three ranks on three emulated nodes (network namespaces joined by
# shaped links, notebook 12), and `distlab.chaos(cut={2: 30})` brings node 2's link down right after
# step 30 of 300 (the loop goes on past 300 until node 2's new rank has joined). A new rank on a
# node is forked from the same template as the warm spares of the section above, torch and torchft
# already imported, and then joins the node's network namespace: it does not import anything again.
# Where nodes cannot be made (no root, e.g. on Binder), rank 2 is killed at step 30 instead, and the
# cell says so.
#
# **Predict**: do ranks 0 and 1 lose a step? Does node 2's new rank heal within a second, as the
# crashed rank's did above, or does it miss many steps?

# %%
from distlab.cluster.nodes import nodes_here

# True where emulated nodes can be made; elsewhere False, after one line saying why not
on_nodes = nodes_here("rank 2 is killed at step 30 instead of cut off")
nodes = "--nodes 3 --link 1gbit" if on_nodes else ""

# %%
# %dist stop
# %dist start -n 3 {nodes} --heal
lab = distlab.current_lab()
lab.push(CUT=on_nodes)

# %%
# %%ddp
import time
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = distlab.heal(model, opt)
manager = distlab.rank.heal.current().manager
if CUT:
    distlab.chaos(cut={2: 30})       # node 2's link goes down after step 30, and its rank is fenced
else:
    distlab.chaos(kill={2: 30})      # no nodes here: rank 2 dies after step 30 instead
committed = []
g = torch.Generator(device=device).manual_seed(100 + rank)
# 300 steps, and on until node 2's new rank has joined the quorum, which on a loaded machine can
# take longer than 300 steps (at most 2 minutes more).
give_up = time.time() + 120
while manager.current_step() < 300 or (manager.num_participants() < world_size and time.time() < give_up):
    opt.zero_grad()
    model(torch.randn(32, 64, generator=g, device=device)).square().mean().backward()
    opt.step()
    committed.append((manager.current_step(), time.time()))
    time.sleep(0.03)

# %% [markdown]
# Each step's quorum, as the ranks recorded it (`lab.heals()`, the same record the dashboard draws),
# and every replica's weights, bit for bit:

# %% tags=["nbval-check-output"]
record = lab.heals()
weights = lab.run(digest, stream=False)
print("ranks 0 and 1 took part in every step after the first:",
      all({0, 1} <= set(s.participants) for s in record.steps if s.step >= 2))
print("node 2's rank was out of the quorum from step 31:", min(record.skipped[2]) == 31)
print("a new rank 2 healed from a live peer:", any(h.rank == 2 and h.replacement for h in record.heals))
print("every replica's weights bit-identical:", len(set(weights.values())) == 1)
print("after the cell the three ranks all-reduce together again:",
      lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False) == {0: 3.0, 1: 3.0, 2: 3.0})

# %% [markdown]
# What each side lost, in steps and seconds, next to a restart from a checkpoint every 25 steps:

# %%
kept = lab.run("committed", stream=False)
first = kept[0]
step_s = (first[29][1] - first[9][1]) / 20                 # a step before the cut
healed = next(h for h in record.heals if h.rank == 2 and h.replacement)
missed = record.skipped[2]
redone = sum(1 for (a, _), (b, _) in zip(first, first[1:]) if b <= a)   # a step that did not commit
print(f"ranks 0 and 1: {redone} steps redone; their longest wait between two steps was "
      f"{max(b[1] - a[1] for a, b in zip(first, first[1:])):.2f} s (a step takes {step_s * 1e3:.0f} ms)")
print(f"node 2: out for {len(missed)} steps ({missed[0]} to {missed[-1]}, {len(missed) * step_s:.1f} s); "
      f"its new rank healed at step {healed.step} from rank {healed.source}: "
      f"{healed.bytes / 1e3:.0f} kB in {healed.seconds:.2f} s")
redo_s = theory.lost_work_s(30 * step_s, 25 * step_s)
print(f"restart from a checkpoint every 25 steps: {redo_s / step_s:.0f} steps redone on every rank, "
      "after every rank has restarted")

# %% [markdown]
# The survivors lost no step: their quorum went on without node 2 after the lighthouse's heartbeat
# timeout, which shows as their longest wait between two steps (the crash above cost them the same).
# Node 2's work is what the cut cost: the steps from the cut until its new rank healed. Most of it
# passed before anyone knew. The fenced rank died behind its cut link, so nothing told the controller
# at once (a death on a live link is told by the rank's nanny within milliseconds, as in the crash
# above): the controller took node 2's rank for dead only once it had heard no heartbeat from it for
# 5 s (20 beats of 250 ms, the lab's setting on nodes). Its replacement, forked into the node with
# torch and torchft already imported, then ran the cell within a second (the lab's line above says
# how long) and healed at its first quorum. A cluster pays the same: a node that goes silent is
# declared dead only after a timeout, and the shorter the timeout, the more often a slow node is
# taken for a dead one. None of the lost work is redone: the new rank takes the live state, and the
# job's step count never went back.

# %% [markdown]
# ## A rank that stalls, and the lighthouse itself
#
# Two more faults, and neither is a death. A rank can *stall*: alive, heartbeating, but not taking
# steps (a swap storm, a slow disk, a long garbage collection). The lighthouse cannot take it for dead,
# since its heartbeats still arrive. It waits for a live replica that has not asked to join only as long
# as its **join timeout** (10 s in this lab; torchft's default is 60 s, longer than the ranks' own 30 s
# quorum timeout), then forms the quorum without it. When the rank comes back it is behind the quorum's
# step, and its next quorum heals it *forward* from a live peer.
#
# The lighthouse is the one process every quorum needs: a single point of failure. What it holds is
# soft (who is heartbeating, the last quorum), so a new one on the same address can take over, and the
# lab starts one the moment the old one dies. But each rank's manager had a quorum request open with the
# old lighthouse, and that request is not sent again. It fails when torchft's quorum timeout, 30 s,
# runs out. distlab turns the failure into a step that does not commit, and the next step asks the new
# lighthouse.
#
# The cell below has both faults: `distlab.chaos(stall={1: (20, 12)})` stops rank 1 for 12 s before its
# step 20, and `distlab.chaos(lighthouse=200)` has rank 0 kill the lighthouse after step 200.
#
# **Predict**: how long do ranks 0 and 2 pause for the stall, and for the lighthouse? How many of rank
# 1's steps does the stall cost? Does any step commit twice, or any replica end different?

# %%
# %%ddp
import time
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = distlab.heal(model, opt)
manager = distlab.rank.heal.current().manager
distlab.chaos(stall={1: (20, 12)}, lighthouse=200)
seen = []  # (step, time) after every iteration: a step that did not commit repeats the one before
g = torch.Generator(device=device).manual_seed(100 + rank)
for step in range(300):
    opt.zero_grad()
    model(torch.randn(32, 64, generator=g, device=device)).square().mean().backward()
    opt.step()
    seen.append((manager.current_step(), time.time()))
    time.sleep(0.03)

# %% [markdown]
# The survivors' pauses, rank 1's missed steps, and the replicas:

# %% tags=["nbval-check-output"]
record = lab.heals()
seen = lab.run("seen", stream=False)
weights = lab.run(digest, stream=False)
pauses = sorted(((b[1] - a[1], a[0]) for a, b in zip(seen[0], seen[0][1:])), reverse=True)[:2]
stall_pause, light_pause = sorted(pauses, key=lambda p: p[1])
missed = record.skipped[1]
back = next(h for h in record.heals if h.rank == 1 and h.step > 1)
print("the stall: ranks 0 and 2 paused between 10 and 12 s:", 10 <= stall_pause[0] < 12)
print("rank 1 missed the steps from 21 on, and healed forward at the next:",
      missed[0] == 21 and back.step == missed[-1] + 1 and not back.replacement)
print("the lighthouse: the survivors paused between 30 and 32 s:", 30 <= light_pause[0] < 32)
print("one iteration did not commit, and every rank's step count ended at 299:",
      sum(1 for a, b in zip(seen[0], seen[0][1:]) if b[0] == a[0]) == 1
      and {r: s[-1][0] for r, s in seen.items()} == {0: 299, 1: 299, 2: 299})
print("every replica's weights bit-identical:", len(set(weights.values())) == 1)

# %%
print(f"stall: {stall_pause[0]:.1f} s of waiting for ranks 0 and 2, then {len(missed)} steps without rank 1 "
      f"({missed[0]} to {missed[-1]}); it healed at step {back.step} from rank {back.source} in {back.seconds:.2f} s")
print(f"lighthouse: {light_pause[0]:.1f} s without a step, after step {light_pause[1]}")

# %% [markdown]
# The stall cost the others the join timeout once: after that their quorums formed at once, without
# rank 1 (the lighthouse forms a quorum without waiting when every member of the last one has asked).
# Rank 1 lost the steps it was away for, and took none twice: it came back at the others' step, and its
# loop, which counts from zero, ended where theirs did. The lighthouse's death cost every rank one
# quorum timeout and one step, and nothing else: nobody healed, because nobody fell behind. A shorter
# quorum timeout would shorten that pause, but a timeout shorter than the longest a quorum can take to
# form (the join timeout, a replacement's first quorum) would fail steps that would have succeeded.

# %% [markdown]
# ## Practice

# %%
# %quiz fault-tolerance -n 4

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise atomic-checkpoint`: a save that survives a SIGKILL: the grader kills it mid-write, then loads.

# %%
shutil.rmtree(work)
# %dist stop
