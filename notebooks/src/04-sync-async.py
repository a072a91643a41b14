# %% [markdown]
# # 04 · Synchronous or asynchronous; parameter server or all-reduce
#
# Two questions decide how the workers of a data-parallel job agree on the weights:
#
# * **who aggregates?** A **parameter server** collects every worker's gradient, applies the update
#   and sends the new weights back; with **all-reduce** the workers sum the gradients among themselves,
#   peer to peer, and each applies the same update.
# * **when?** **Synchronously**: every update waits for every worker's gradient (stable, identical to a
#   bigger batch, but as slow as the slowest worker). **Asynchronously**: the server applies each
#   gradient the moment it arrives (nobody waits, but a gradient may have been computed on weights
#   that have changed since: a **stale** gradient).
#
# This lab builds a parameter server out of plain `send` / `recv` between ranks, runs it both ways, and
# compares it with all-reduce. It needs one server and two workers, so it starts **3 ranks**: rank 0 is
# the server, ranks 1 and 2 are the workers.

# %%
# %load_ext distlab
# %dist start -n 3

# %% [markdown]
# ## Pieces shared by every run
#
# The model travels as one flat vector of its parameters (`parameters_to_vector`), and so do
# gradients. Worker `r` trains on its own half of the digits. The server scores the weights it holds on
# the whole data set after every update, so we can compare how fast each scheme learns.

# %%
# %%ddp
import time
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from sklearn.datasets import load_digits

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32) / 16.0    # CPU, as the parameter server is (below)
Y = torch.tensor(digits.target)                                # CPU, as X
SERVER, WORKERS, LR, BATCH = 0, [1, 2], 0.1, 32

def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

def batch(worker, i):
    mine = torch.arange(worker - 1, len(Y), len(WORKERS))      # worker 1: even rows, 2: odd rows (CPU, as Y)
    rows = mine[torch.arange(i * BATCH, (i + 1) * BATCH) % len(mine)]   # indices into X: CPU, as X is
    return X[rows], Y[rows]

def full_loss(net, w):
    vector_to_parameters(w, net.parameters())
    with torch.no_grad():
        return F.cross_entropy(net(X), Y).item()

def gradient(net, w, x, y):
    vector_to_parameters(w, net.parameters())
    net.zero_grad(set_to_none=True)
    F.cross_entropy(net(x), y).backward()
    return torch.cat([p.grad.flatten() for p in net.parameters()])

workers_group = dist.new_group(WORKERS)       # every rank takes part in making a group
# The parameter server's messages go over gloo, with CPU tensors, on GPU ranks too: its asynchronous
# server receives from whichever worker is first, which NCCL cannot do (gloo can).
ps_group = dist.new_group(backend="gloo")


# %% [markdown]
# ## A parameter server, two ways
#
# **Server.** It sends the initial weights to both workers, then loops. In the synchronous version it
# receives one gradient from *each* worker, averages them, updates, and sends the new weights to
# both. In the asynchronous version it receives from *whichever worker is first* (`dist.recv` with no
# source), updates with that gradient alone, and sends the new weights back to that worker only. For
# each gradient it notes the **staleness**: how many updates were applied between the moment the worker
# got its weights and the moment its gradient arrived. Every message to a worker carries the weights
# and one more number, a flag: 1 to go on, 0 to stop. The asynchronous server stops when it has
# applied its number of updates, whoever sent them; a gradient that arrives after that is dropped.
#
# **Worker.** Receive weights, compute a gradient on the next batch, send it, wait for new weights,
# until told to stop. `delay` is a sleep per gradient: it stands for the time a real worker spends
# computing (ours take about a millisecond), and makes each worker's pace known in advance. A larger
# `delay` on one worker makes it a straggler.

# %%
# %%ddp
def server(updates, synchronous):
    net = make_net()                            # CPU: the server's messages go over gloo (ps_group)
    w = parameters_to_vector(net.parameters()).detach().clone()

    def go(flag):                               # the weights, and 1 (go on) or 0 (stop)
        return torch.cat([w, torch.tensor([float(flag)])])   # CPU, as w is

    for dst in WORKERS:
        dist.send(go(1), dst, group=ps_group)
    fetched = {r: 0 for r in WORKERS}          # version of the weights each worker holds
    version, staleness, losses, g = 0, [], [full_loss(net, w)], torch.empty_like(w)
    t0 = time.perf_counter()
    if synchronous:
        while version < updates:
            total = torch.zeros_like(w)
            for src in WORKERS:
                dist.recv(g, src, group=ps_group)
                staleness.append((src, version - fetched[src]))
                total += g
            w -= LR * total / len(WORKERS)
            version += 1
            losses.append(full_loss(net, w))
            for dst in WORKERS:
                dist.send(go(version < updates), dst, group=ps_group)
                fetched[dst] = version
        seconds = time.perf_counter() - t0
    else:
        running = set(WORKERS)
        while running:
            src = dist.recv(g, group=ps_group)  # any worker: the first to arrive
            if version < updates:
                staleness.append((src, version - fetched[src]))
                w -= LR * g
                version += 1
                losses.append(full_loss(net, w))
                if version == updates:
                    seconds = time.perf_counter() - t0
            if version < updates:
                dist.send(go(1), src, group=ps_group)
                fetched[src] = version
            else:
                dist.send(go(0), src, group=ps_group)   # done: this worker stops
                running.discard(src)
    return {"seconds": seconds, "staleness": staleness, "losses": losses, "w": w}

def worker(delay):
    net = make_net()                            # CPU, as the server (ps_group is gloo)
    msg = torch.empty(sum(p.numel() for p in net.parameters()) + 1)   # CPU, for gloo
    dist.recv(msg, SERVER, group=ps_group)
    t0, sent = time.perf_counter(), 0
    while msg[-1] == 1:
        g = gradient(net, msg[:-1], *batch(rank, sent))
        time.sleep(delay)
        dist.send(g, SERVER, group=ps_group)
        sent += 1
        dist.recv(msg, SERVER, group=ps_group)
    return {"gradients": sent, "pace_s": (time.perf_counter() - t0) / sent}

def run_ps(updates, synchronous, delays):
    if rank == SERVER:
        return server(updates, synchronous)
    return worker(delays[WORKERS.index(rank)])


# %% [markdown]
# Both versions get the same budget: **60 gradients** of 32 samples. The synchronous server turns
# them into 30 updates of 64 samples each, the asynchronous one into 60 updates of 32. Both workers
# take 20 ms per gradient.

# %%
# %%ddp
even = (0.02, 0.02)
sync_ps = run_ps(30, synchronous=True, delays=even)
async_ps = run_ps(60, synchronous=False, delays=even)
if rank == SERVER:
    for name, r in (("synchronous", sync_ps), ("asynchronous", async_ps)):
        print(f"{name:>12}: {len(r['losses']) - 1} updates in {r['seconds'] * 1e3:.0f} ms, "
              f"full-data loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, "
              f"staleness seen: {sorted(set(s for _, s in r['staleness']))}")

# %%
from collections import Counter
import torch
import distlab
from distlab import theory

lab = distlab.current_lab()
sync_ps, async_ps = lab.pull("sync_ps", ranks=0)[0], lab.pull("async_ps", ranks=0)[0]
even = lab.pull("even", ranks=0)[0]
async_staleness = [s for _, s in async_ps["staleness"]]
mean_staleness = sum(async_staleness) / len(async_staleness)
print("asynchronous staleness, gradients per value:", dict(sorted(Counter(async_staleness).items())))
print(f"mean staleness {mean_staleness:.2f}; for 2 equally fast workers the model expects "
      f"{theory.expected_staleness_updates(2)}")
even_pace = [v["pace_s"] for v in lab.pull("async_ps", ranks=[1, 2]).values()]
print(f"time for 60 gradients: synchronous {sync_ps['seconds']:.2f} s, asynchronous {async_ps['seconds']:.2f} s; "
      f"the model says {theory.synchronous_run_time_s(30, even):.2f} s for both "
      f"(the workers' measured pace: {even_pace[0] * 1e3:.1f} and {even_pace[1] * 1e3:.1f} ms per gradient)")

# %% [markdown]
# With two equally fast workers, while one computes its gradient the other's lands on the server, so a
# typical asynchronous gradient is one update old: the mean is close to the model's N - 1 = 1.
#
# With nobody slow, the model gives both runs the same time: each worker delivers one gradient every
# 20 ms either way, and the measured times are close to each other. Both take longer than the model's
# 0.6 s, since each gradient also costs a few milliseconds of computing and messaging between three
# processes on two cores (the measured pace above). When the machine is busy the synchronous run can
# fall behind: every one of its 30 rounds waits for the *later* of two workers, so any hiccup of
# either one delays the round, where the asynchronous server takes whoever is ready. A straggler,
# below, is the extreme case of the same thing.
#
# Per gradient computed, the asynchronous run got further here. That is not staleness being good: it
# made 60 small updates where the synchronous run made 30 averaged ones, at the same learning rate,
# and a batch twice as large would normally get a larger learning rate (notebook 07). What costs is
# staleness growing with the number of workers: with 100 workers a gradient is about 99 updates old
# when it lands, computed for weights that no longer exist, and large learning rates then make the
# updates fight each other.
#
# What can be relied on whatever the timing:

# %% tags=["nbval-check-output"]
print("synchronous gradients are never stale:", {s for _, s in sync_ps["staleness"]} == {0})
print("asynchronous updates used stale gradients:", max(async_staleness) >= 1)
print("mean asynchronous staleness within 0.2 of the model's N - 1 = 1:",
      abs(mean_staleness - theory.expected_staleness_updates(2)) < 0.2)
print("both learned:", sync_ps["losses"][-1] < sync_ps["losses"][0] and async_ps["losses"][-1] < async_ps["losses"][0])

# %% [markdown]
# ## The same synchronous update, by all-reduce
#
# Drop the server: the two workers all-reduce their gradients within their own group
# (`process_group=workers_group`) through DDP, and each applies the averaged gradient. The arithmetic
# is the synchronous server's, so after 30 updates the weights must agree with the server's. The
# dashboard shows the two workers (rank 0 sits this one out).

# %%
# %%ddp
from torch.nn.parallel import DistributedDataParallel as DDP

if rank in WORKERS:
    model = DDP(make_net().to(device), process_group=workers_group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with distlab.watch(model, checksum_every=1):
        for i in range(30):
            x, y = batch(rank, i)
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            distlab.log(loss=loss)
    allreduce_w = parameters_to_vector(model.module.parameters()).detach().cpu()   # for the notebook

# %% tags=["nbval-check-output"]
allreduce_w = lab.pull("allreduce_w", ranks=[1, 2])
print("all-reduce workers agree with each other:", torch.equal(allreduce_w[1], allreduce_w[2]))
print("all-reduce gives the synchronous server's weights:", torch.allclose(allreduce_w[1], sync_ps["w"], atol=1e-5))

# %% [markdown]
# Same update, different traffic. The server's link carries every worker's gradient in and fresh
# weights out, so it grows with the number of workers; in a ring all-reduce each worker sends about
# twice the gradient size whatever their number. For 8 workers and a 400 MB gradient:

# %% tags=["nbval-check-output"]
print("parameter server receives per step, GB:", theory.parameter_server_received_bytes(400e6, workers=8) / 1e9)
print("each worker sends in a ring all-reduce, GB:", theory.ring_allreduce_sent_bytes(400e6, workers=8) / 1e9)
print("with the server sharded over 4 machines, each receives, GB:",
      theory.parameter_server_received_bytes(400e6, workers=8, servers=4) / 1e9)

# %% [markdown]
# ## A straggler
#
# Now worker 2 is slow: it takes 65 ms per gradient, worker 1 still 20 ms. The synchronous server
# waits for worker 2 on every update: a synchronous step takes as long as its slowest worker. The
# asynchronous server applies whatever arrives, so worker 1 is never held up. Both runs apply 60
# gradients, as before. Before running it, predict:

# %%
from distlab.quiz import predict

slow = (0.020, 0.065)                               # seconds per gradient: worker 1, worker 2
lab.push(slow=slow)                                 # the ranks get it too
sync_model = theory.synchronous_run_time_s(30, slow)
async_model = theory.asynchronous_run_time_s(60, slow)
faster = "async" if async_model < 0.8 * sync_model else "sync" if sync_model < 0.8 * async_model else "same"
race = predict("Worker 2 takes 65 ms per gradient, worker 1 20 ms. Which run applies its 60 gradients first?",
               choices={"sync": "synchronous", "async": "asynchronous", "same": "about the same"}, answer=faster)
race

# %%
# %%ddp
sync_slow = run_ps(30, synchronous=True, delays=slow)
async_slow = run_ps(60, synchronous=False, delays=slow)

# %%
sync_slow, async_slow = lab.pull("sync_slow", ranks=0)[0], lab.pull("async_slow", ranks=0)[0]
pace = {r: v["pace_s"] for r, v in lab.pull("async_slow", ranks=[1, 2]).items()}
sent = {r: v["gradients"] for r, v in lab.pull("async_slow", ranks=[1, 2]).items()}
paced = [pace[1], pace[2]]
print(f"{'60 gradients':>14} {'measured':>9} {'model':>7} {'measured/model':>15} {'model at the measured pace':>27} "
      f"{'final loss':>11}")
for name, r, model, at_pace in (
    ("synchronous", sync_slow, sync_model, theory.synchronous_run_time_s(30, paced)),
    ("asynchronous", async_slow, async_model, theory.asynchronous_run_time_s(60, paced)),
):
    print(f"{name:>14} {r['seconds']:>8.2f}s {model:>6.2f}s {r['seconds'] / model:>15.2f} {at_pace:>26.2f}s "
          f"{r['losses'][-1]:>11.3f}")
print(f"\nasynchronous / synchronous time: measured {async_slow['seconds'] / sync_slow['seconds']:.2f}, "
      f"model {async_model / sync_model:.2f}")
print(f"gradients each worker sent in the asynchronous run: worker 1 {sent[1]}, worker 2 {sent[2]} "
      f"(worker 2's last one arrived after the 60th update and was dropped); their pace: "
      f"{pace[1] * 1e3:.1f} and {pace[2] * 1e3:.1f} ms per gradient")
race.reveal("async" if async_slow["seconds"] < 0.8 * sync_slow["seconds"]
            else "sync" if sync_slow["seconds"] < 0.8 * async_slow["seconds"] else "same")

# %% [markdown]
# The model for the synchronous run is 30 updates x 65 ms (`theory.synchronous_run_time_s`): worker 1
# spends two thirds of the run waiting. For the asynchronous one (`theory.asynchronous_run_time_s`),
# worker 1 delivers a gradient every 20 ms and worker 2 one every 65 ms, about 50 + 15 gradients a
# second together, so 60 gradients take about 0.92 s. Both measured times are above their model by
# the few milliseconds each gradient also costs in computing and messaging, which the model leaves
# out; given the workers' measured pace instead (the second model column), the same two functions
# land within a few percent of the measurements.
#
# Staleness now depends on the worker. While worker 2 computes one gradient, worker 1 lands about
# 65/20 = 3.25 updates, so worker 2's gradients are about 3 updates old; worker 1's are rarely stale
# (only when one of worker 2's lands in between: 20/65 = 0.31 on average). The model for each worker
# is `theory.worker_staleness_updates`; over all updates the mean is still N - 1 = 1:

# %%
WORKERS = lab.pull("WORKERS", ranks=0)[0]
by_worker = {r: [s for src, s in async_slow["staleness"] if src == r] for r in WORKERS}
model_staleness = dict(zip(WORKERS, theory.worker_staleness_updates(list(slow))))
model_measured_pace = dict(zip(WORKERS, theory.worker_staleness_updates([pace[1], pace[2]])))
print(f"{'worker':>7} {'gradients applied':>18} {'mean staleness':>15} {'model':>6} {'model at the measured pace':>27}")
for r in WORKERS:
    print(f"{r:>7} {len(by_worker[r]):>18} {sum(by_worker[r]) / len(by_worker[r]):>15.2f} "
          f"{model_staleness[r]:>6.2f} {model_measured_pace[r]:>27.2f}")
all_slow = [s for _, s in async_slow["staleness"]]
print(f"{'all':>7} {len(all_slow):>18} {sum(all_slow) / len(all_slow):>15.2f} {theory.expected_staleness_updates(2):>6}")

# %% [markdown]
# The straggler costs the asynchronous run something else: worker 1 supplied about three quarters of
# the gradients, and worker 1 only ever sees the even rows of the data set. With a real split of data
# between workers, a slow worker's data is under-represented in an asynchronous run; a synchronous
# one weighs every worker's batch equally.

# %% [markdown]
# The checks below hold what the straggler changes, each an effect far larger than what other work on
# the machine can move: the paces are sleeps of 20 and 65 ms, and every gradient also costs a few
# milliseconds of computing and messaging, which a busy machine raises for both workers alike. The
# asynchronous run's time (0.47 of the synchronous one's in the model) and the straggler's staleness
# (3.25 updates in the model, 10x worker 1's) are compared with their models in the tables above, not
# checked here: they move with that cost. With 20 ms more per gradient on each worker, the time ratio
# would be 0.64 and the staleness 2.1 updates, 4.5x worker 1's; the model at the measured pace (the
# tables' last column) follows the measurement either way.

# %% tags=["nbval-check-output"]
print("with a straggler, asynchronous finishes first:", async_slow["seconds"] < sync_slow["seconds"])
stale = {r: sum(v) / len(v) for r, v in by_worker.items()}
print("the straggler's gradients are the stalest (more than 2x worker 1's, on average):", stale[2] > 2 * stale[1])
print("worker 1 supplied most of the updates:", len(by_worker[1]) > len(by_worker[2]))

# %% [markdown]
# What to take away:
#
# * synchronous training is **equivalent to one bigger batch**: predictable, reproducible, and the
#   reason all-reduce data parallelism (DDP, Horovod) is the default today; its cost is waiting for
#   stragglers (here: twice the time with one worker 3x slower);
# * asynchronous training keeps every worker busy, but each update uses a gradient computed on old
#   weights, staler the slower the worker and the more workers there are, and a slow worker's data
#   counts less. Chen et al. (2016), "Revisiting Distributed Synchronous SGD", weighed the two at
#   scale: synchronous training with a few *backup workers* (each step uses the first N of N + b
#   gradients to arrive and drops the stragglers') avoids the staleness, mitigates the worst
#   stragglers, and converged faster and to better test accuracy than asynchronous training;
# * a parameter server concentrates traffic on the server's links (shard it over several machines to
#   spread it); all-reduce spreads it evenly over all workers.
#
# ## Practice

# %%
# %quiz sync-async -n 4

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise parameter-server`: a synchronous parameter server from `send` and `recv`, checked against the same update by collectives.

# %%
# %dist stop
