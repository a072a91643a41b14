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
X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
Y = torch.tensor(digits.target)
SERVER, WORKERS, LR, BATCH = 0, [1, 2], 0.1, 32

def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

def batch(worker, i):
    mine = torch.arange(worker - 1, len(Y), len(WORKERS))      # worker 1: even rows, 2: odd rows
    rows = mine[torch.arange(i * BATCH, (i + 1) * BATCH) % len(mine)]
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


# %% [markdown]
# ## A parameter server, two ways
#
# **Server.** It sends the initial weights to both workers, then loops. In the synchronous version it
# receives one gradient from *each* worker, averages them, updates, and sends the new weights to
# both. In the asynchronous version it receives from *whichever worker is first* (`dist.recv` with no
# source), updates with that gradient alone, and sends the new weights back to that worker only. For
# each gradient it notes the **staleness**: how many updates were applied between the moment the worker
# got its weights and the moment its gradient arrived.
#
# **Worker.** Receive weights, compute a gradient on the next batch, send it, wait for new weights.
# `delay` makes a worker slower, as a straggler would be.

# %%
# %%ddp
def server(updates, synchronous):
    net = make_net()
    w = parameters_to_vector(net.parameters()).detach().clone()
    for dst in WORKERS:
        dist.send(w, dst)
    fetched = {r: 0 for r in WORKERS}          # version of the weights each worker holds
    version, staleness, losses, g = 0, [], [full_loss(net, w)], torch.empty_like(w)
    t0 = time.perf_counter()
    while version < updates:
        if synchronous:
            total = torch.zeros_like(w)
            for src in WORKERS:
                dist.recv(g, src)
                staleness.append(version - fetched[src])
                total += g
            w -= LR * total / len(WORKERS)
            version += 1
            for dst in WORKERS:
                dist.send(w, dst)
                fetched[dst] = version
        else:
            src = dist.recv(g)                  # any worker: the first to arrive
            staleness.append(version - fetched[src])
            w -= LR * g
            version += 1
            dist.send(w, src)
            fetched[src] = version
        losses.append(full_loss(net, w))
    return {"seconds": time.perf_counter() - t0, "staleness": staleness, "losses": losses, "w": w}

def worker(gradients, delay=0.0):
    net = make_net()
    w = parameters_to_vector(net.parameters()).detach().clone()
    dist.recv(w, SERVER)
    for i in range(gradients):
        g = gradient(net, w, *batch(rank, i))
        time.sleep(delay)
        dist.send(g, SERVER)
        dist.recv(w, SERVER)
    return w

def run_ps(updates, synchronous, delays=(0.0, 0.0)):
    if rank == SERVER:
        return server(updates, synchronous)
    grads = updates if synchronous else updates // len(WORKERS)
    worker(grads, delays[WORKERS.index(rank)])


# %% [markdown]
# Both versions get the same budget: **60 gradients** of 32 samples. The synchronous server turns
# them into 30 updates of 64 samples each, the asynchronous one into 60 updates of 32.

# %%
# %%ddp
sync_ps = run_ps(30, synchronous=True)
async_ps = run_ps(60, synchronous=False)
if rank == SERVER:
    for name, r in (("synchronous", sync_ps), ("asynchronous", async_ps)):
        print(f"{name:>12}: {len(r['losses']) - 1} updates in {r['seconds'] * 1e3:.0f} ms, "
              f"full-data loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, "
              f"staleness seen: {sorted(set(r['staleness']))}")

# %%
from collections import Counter
import torch
import distlab
from distlab import theory

lab = distlab.current_lab()
sync_ps, async_ps = lab.pull("sync_ps", ranks=0)[0], lab.pull("async_ps", ranks=0)[0]
print("asynchronous staleness, gradients per value:", dict(sorted(Counter(async_ps["staleness"]).items())))
print(f"mean staleness {sum(async_ps['staleness']) / len(async_ps['staleness']):.2f}; "
      f"for 2 equally fast workers the model expects {theory.expected_staleness_updates(2)}")

# %% [markdown]
# With two equally fast workers, while one computes its gradient the other's lands on the server, so a
# typical asynchronous gradient is one update old.
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
print("synchronous gradients are never stale:", set(sync_ps["staleness"]) == {0})
print("asynchronous updates used stale gradients:", max(async_ps["staleness"]) >= 1)
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
    model = DDP(make_net(), process_group=workers_group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with distlab.watch(model, checksum_every=1):
        for i in range(30):
            x, y = batch(rank, i)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            distlab.log(loss=loss)
    allreduce_w = parameters_to_vector(model.module.parameters()).detach()

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
# Now worker 2 is slow: it sleeps 20 ms per gradient. The synchronous server waits for it on every
# update (a synchronous step takes as long as its slowest worker). The asynchronous server keeps
# applying worker 1's gradients, and worker 2's gradients arrive later and staler.

# %%
# %%ddp
slow = (0.0, 0.02)
sync_slow = run_ps(30, synchronous=True, delays=slow)
async_slow = run_ps(60, synchronous=False, delays=slow)

# %%
sync_slow, async_slow = lab.pull("sync_slow", ranks=0)[0], lab.pull("async_slow", ranks=0)[0]
for name, r in (("synchronous", sync_slow), ("asynchronous", async_slow)):
    print(f"{name:>12}: {r['seconds'] * 1e3:5.0f} ms for {len(r['losses']) - 1} updates, "
          f"final loss {r['losses'][-1]:.3f}, largest staleness {max(r['staleness'])}")
print("a synchronous step waits for the slowest worker:",
      f"{theory.synchronous_step_time_s([0.001, 0.021]) * 1e3:.0f} ms if they take 1 and 21 ms")

# %% [markdown]
# What to take away:
#
# * synchronous training is **equivalent to one bigger batch**: predictable, reproducible, and the
#   reason all-reduce data parallelism (DDP, Horovod) is the default today; its cost is waiting for
#   stragglers;
# * asynchronous training keeps every worker busy, but each update uses a gradient computed on old
#   weights. With a few workers the harm is small; with many workers, or a learning rate tuned for
#   synchronous training, staleness slows convergence or makes it diverge;
# * a parameter server concentrates traffic on the server's links (shard it over several machines to
#   spread it); all-reduce spreads it evenly over all workers.
#
# ## Practice

# %%
# %quiz sync-async -n 4

# %%
# %dist stop
