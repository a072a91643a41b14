# %% [markdown]
# # 21b · Averaging less often: local SGD and DiLoCo across a slow link
#
# DDP all-reduces every gradient at every step. Inside a node that is cheap; between sites, or across
# a link shared with other jobs, the all-reduce becomes the step. Two methods send less:
#
# - **Local SGD** (Lin et al. 2018): each rank takes `H` steps on its own data, then the models are
#   averaged, one all-reduce of the parameters. Parameters and gradients have the same size, so that is
#   `1/H` of DDP's bytes (`theory.local_sgd_bytes_per_step`).
# - **DiLoCo** (Douillard et al. 2023): the same `H` inner steps (AdamW in the paper), then the
#   averaged change of the `H` steps is treated as a gradient for an *outer* optimizer, SGD with
#   Nesterov momentum (lr 0.7, momentum 0.9 in the paper). The bytes are local SGD's.
#
# Here 4 ranks run on 2 emulated nodes, 2 on each, joined by a 100 Mbit/s link (12.5 MB/s each way),
# as in notebook 12. The same small model learns the same task three ways, for the same number of
# steps: DDP, local SGD and DiLoCo, both at `H = 25`. We time every run, count the bytes each puts on
# the link, and follow the loss against the seconds spent.
#
# Making the nodes takes root's CAP_NET_ADMIN or a user namespace of the lab's own. Where neither can
# be had (some containers, on Binder perhaps), the cell below says so and starts the same four ranks on
# loopback: everything below still runs, but the times then measure the CPU copying bytes, not a
# link, so each cell whose result needs the link also shows what it printed in the run on nodes this
# notebook was saved from, every line marked `saved |`.

# %%
# %load_ext distlab
import distlab
from distlab.cluster.nodes import nodes_here
from distlab.notebook.saved import saved_from_nodes

# True where emulated nodes can be made; elsewhere False, after one line saying why not
on_nodes = nodes_here("4 ranks on loopback instead, so the times below are CPU copying, not a link")
saved = saved_from_nodes("21b-local-sgd-diloco")   # without nodes: what the cells printed on them, marked saved
nodes = "--nodes 2 --link 100mbit" if on_nodes else ""

# %%
# %dist start -n 4 {nodes}

# %% [markdown]
# ## The task and the three ways to train
#
# Every rank learns the same function, a fixed random "teacher" network, from its own stream of random
# inputs: the ranks' data come from one distribution, the setting DiLoCo was made for. The student has
# three layers, 128 wide: 20,865 parameters, 83,460 bytes in float32. Every rank uses AdamW at the
# same learning rate, and the loss is measured on 1,024 held-out inputs every 100 steps, the seconds
# spent measuring not counted.
#
# `train()` runs one of the three:
#
# - `train()`: DDP, an all-reduce of the gradients in every step's `backward()`;
# - `train(h=25)`: local SGD, the models averaged after every 25th step;
# - `train(h=25, outer=True)`: DiLoCo, the average's change handed to the outer optimizer.

# %%
# %%ddp
import time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)               # four ranks share this machine's cores: one thread each
STEPS, EVERY, LR, WIDTH = 1000, 100, 1e-3, 128

torch.manual_seed(123)
teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
with torch.no_grad():
    teacher[2].weight.mul_(4)            # a target of variance about 0.6
x_test = torch.randn(1024, 32, generator=torch.Generator().manual_seed(99)).to(device)
with torch.no_grad():
    y_test = teacher(x_test)


def make_model():
    torch.manual_seed(0)                 # every rank starts from the same weights
    return nn.Sequential(nn.Linear(32, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 1)).to(device)


def test_loss(model):
    with torch.no_grad():
        return nn.functional.mse_loss(model(x_test), y_test).item()


def average_(model, anchor, outer_opt):
    """Average the ranks' models (one all-reduce); with an outer optimizer, DiLoCo's outer step."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().flatten() for p in params])
    dist.all_reduce(flat)
    flat /= world_size
    with torch.no_grad():
        for p, a, mean in zip(params, anchor, flat.split([p.numel() for p in params])):
            if outer_opt is None:
                p.copy_(mean.view_as(p))                 # local SGD: every rank takes the average
            else:
                a.grad = a - mean.view_as(a)             # DiLoCo: the averaged change, as a gradient
        if outer_opt is not None:
            outer_opt.step()                             # Nesterov SGD on the weights of the last average
            for p, a in zip(params, anchor):
                p.copy_(a)


def train(h=None, outer=False, steps=STEPS):
    """[(step, seconds so far, test loss)] every EVERY steps: DDP if h is None, else averaged every h."""
    model = make_model()
    net = model if h else DDP(model)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    anchor = [p.detach().clone() for p in model.parameters()]
    outer_opt = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True) if outer else None
    g = torch.Generator().manual_seed(rank)             # this rank's own inputs
    curve, spent = [], 0.0
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(32, 32, generator=g).to(device)
        inner.zero_grad()
        nn.functional.mse_loss(net(x), teacher(x)).backward()
        inner.step()
        if h and step % h == 0:
            average_(model, anchor, outer_opt)
        if step % EVERY == 0:
            spent += time.perf_counter() - start
            curve.append((step, spent, test_loss(model)))
            start = time.perf_counter()                  # the test loss is not counted
    return curve


parameters = sum(p.numel() for p in make_model().parameters())

# %% [markdown]
# ## Predict first: one average across the link
#
# Ranks 0 and 1 sit on `node0`, ranks 2 and 3 on `node1`, so a ring all-reduce of the 4 ranks crosses
# the link twice, once each way. Every rank sends `2(N-1)/N * S = 1.5 S` to its neighbour in the ring
# (Thakur, Rabenseifner and Gropp 2005), and for rank 1 (and rank 3) that neighbour is on the other
# node: the link carries `1.5 S` each way, at 12.5 MB/s. DDP pays this at every step, local SGD and
# DiLoCo at every 25th.

# %%
from distlab import theory
from distlab.quiz import predict

lab = distlab.current_lab()
S = 4 * lab.pull("parameters", 0)[0]
LINK = 100e6 / 8                                          # 100 Mbit/s, in bytes a second
RING = [0, 0, 1, 1]                                       # each rank's node
guess = predict(f"An all-reduce of the model's {S:,} bytes over the 4 ranks, 2 on each node, the nodes joined by "
                "100 Mbit/s: how many milliseconds, by the ring model without its latency term?",
                theory="tiered_allreduce_time_s", unit="ms", tolerance=0.2,
                size_bytes=S, nodes=RING, link_bytes_per_s=LINK)
guess

# %% [markdown]
# **Then measure**: 20 all-reduces of the flattened parameters, each after a barrier, the median of
# the slowest rank; and one step's compute alone, from 200 steps that send nothing (the second 100
# timed: the first steps also make AdamW's state and warm the allocator).

# %%
# %%ddp
flat = torch.cat([p.detach().flatten() for p in make_model().parameters()])
times = []
for _ in range(21):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(flat)
    times.append(time.perf_counter() - t0)
one_average = torch.tensor(sorted(times[1:])[10], device=device)
dist.all_reduce(one_average, op=dist.ReduceOp.MAX)
alone = train(h=10**9, steps=200)                          # never averaged: compute only
compute = torch.tensor((alone[-1][1] - alone[0][1]) / 100, device=device)  # the second 100 steps: the first warm up
dist.all_reduce(compute, op=dist.ReduceOp.MAX)
one_average, compute = one_average.item(), compute.item()

# %%
one_average, compute = lab.pull("one_average", 0)[0], lab.pull("compute", 0)[0]
model_s = theory.tiered_allreduce_time_s(S, RING, LINK)
print(f"one all-reduce of {S:,} bytes: measured {1e3 * one_average:.1f} ms, ring model "
      f"{1e3 * model_s:.1f} ms ({one_average / model_s - 1:+.0%})")
print(f"one step's compute, sending nothing: {1e3 * compute:.2f} ms")
if not on_nodes:
    saved("one average")

# %%
guess.reveal(one_average)

# %% [markdown]
# The model counts data only. The link also carries every frame's headers (about 5% more, notebook
# 12), and the ring's 2(N-1) = 6 steps each wait for a message through the TCP stacks of two ranks
# (the latency term left out): the measured all-reduce comes out at or above `1.5 S / B` (between 4%
# and 31% above it in this notebook's runs, the machine's other work deciding how long a rank takes to
# answer). On the link, that one all-reduce costs several times a step's compute. DDP's
# step should then take about `compute + all-reduce`, and an averaging method's about
# `compute + all-reduce / H`.
#
# ## Three runs, the same 1,000 steps
#
# Each run is one `lab.run` of `train`, with the link's byte counters read before and after it (`link
# bytes` counts whole frames, headers included, from the kernel's queue on each node's link).

# %%
RUNS = {"DDP": "train()", "local SGD, H = 25": "train(h=25)", "DiLoCo, H = 25": "train(h=25, outer=True)"}
H = {"DDP": 1, "local SGD, H = 25": 25, "DiLoCo, H = 25": 25}
curves, on_link = {}, {}
for name, call in RUNS.items():
    before = lab.link_bytes() if on_nodes else {}
    lab.run(f"curve = {call}")
    after = lab.link_bytes() if on_nodes else {}
    curves[name] = lab.pull("curve", 0)[0]
    on_link[name] = {node: (after[node] - before[node]) / curves[name][-1][0] for node in after}

ddp_loss = curves["DDP"][-1][2]


def seconds_to(curve, loss):
    """The seconds a run had spent when its test loss first reached `loss` (None if never)."""
    return next((t for _, t, got in curve if got <= loss), None)


print(f"{'run':<18} {'ms a step':>9} {'model':>6} {'KB on the link a step':>22} {'model':>6} "
      f"{'test loss':>10} {'s to reach DDP loss':>20}")
for name, curve in curves.items():
    steps, seconds, loss = curve[-1]
    predicted_s = theory.averaged_step_time_s(compute, one_average, H[name])     # compute + all-reduce / H
    per_step = sum(on_link[name].values()) / max(len(on_link[name]), 1)
    on_wire = f"{per_step / 1e3:>22.1f}" if on_nodes else f"{'(no link)':>22}"
    reached = seconds_to(curve, ddp_loss)
    print(f"{name:<18} {1e3 * seconds / steps:>9.2f} {1e3 * predicted_s:>6.2f} {on_wire} "
          f"{1.5 * S / H[name] / 1e3:>6.1f} {loss:>10.4f} {'never' if reached is None else f'{reached:.2f}':>20}")
if not on_nodes:
    saved("three runs")

# %% [markdown]
# The link columns count bytes each node put on its link per step, the model `1.5 S / H` (data only:
# the frames' headers add about 5%, notebook 12). Now the loss, against the seconds each run spent:

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3.2))
for name, curve in curves.items():
    ax.plot([t for _, t, _ in curve], [loss for _, _, loss in curve], marker="o", label=name)
ax.set_xlabel("seconds of training" + ("" if on_nodes else " (loopback: no link)"))
ax.set_ylabel("test loss")
ax.set_yscale("log")
ax.legend()
plt.show()

# %% [markdown]
# What the ranks must show, checked. The losses do not depend on the link (the same seeds give the
# same numbers on loopback); the times and bytes do.

# %% tags=["nbval-check-output"]
ddp_s, diloco_s = curves["DDP"][-1][1], curves["DiLoCo, H = 25"][-1][1]
print("DiLoCo ends below DDP's test loss, and local SGD above it:",
      curves["DiLoCo, H = 25"][-1][2] < ddp_loss < curves["local SGD, H = 25"][-1][2])
if on_nodes:
    ddp_bytes = sum(on_link["DDP"].values()) / 2
    print("DDP puts 1.5 S a step on each node's link, and up to 15% more:",
          all(1.5 * S < b < 1.15 * 1.5 * S for b in on_link["DDP"].values()))
    print("local SGD and DiLoCo put 1/25 of that on it (within 25%):",
          all(0.75 < 25 * sum(on_link[n].values()) / 2 / ddp_bytes < 1.25 for n in RUNS if n != "DDP"))
    print("DDP's 1,000 steps took more than twice DiLoCo's:", ddp_s > 2 * diloco_s)
    print("DiLoCo reached DDP's final loss in under half DDP's time:",
          seconds_to(curves["DiLoCo, H = 25"], ddp_loss) < ddp_s / 2)
else:
    saved("three runs: checks")

# %% [markdown]
# What the runs show:
#
# - **Bytes.** Averaging every 25 steps puts 1/25 of DDP's bytes on the link, as the model says.
# - **Time.** DDP's step is its compute plus a whole all-reduce across the link, several times the
#   compute here; local SGD's and DiLoCo's steps pay 1/25 of that all-reduce and are nearly pure
#   compute. Next to `compute + all-reduce / H`, each step lands within a few milliseconds of the
#   model, most often above it: four ranks share this machine's cores, so the compute timed alone
#   before the runs is not quite the compute inside them, and DDP's hooks add work of their own.
# - **Loss at equal steps.** Local SGD ends above DDP: between averages each rank follows its own
#   inputs, and the average of four models that drifted apart for 25 steps is not the model one
#   optimizer would have reached on all their data. DiLoCo ends *below* DDP here. Its outer step moves
#   `0.7 * (1 + 0.9) = 1.33` times the averaged change at once, and momentum carries on: as long as
#   successive averages point the same way, the outer steps add up to as much as `0.7 / (1 - 0.9) = 7`
#   times each change. On this smooth task that is acceleration. It is a tuned choice, not a law:
#   momentum that carries the model on can also carry it past where a plain average would stop. The
#   paper tuned these values for language models with `H = 500` inner steps, and reports a loss close
#   to fully synchronous training's for 500 times fewer exchanges (Douillard et al. 2023).
# - **Loss at equal time**, the question a slow link asks: on the plot, DiLoCo and local SGD are
#   finished while DDP is still near its start.
#
# What decides `H`: the link's time for one all-reduce against a step's compute sets how much an
# average costs; the drift between averages, how much it hurts. torchft runs DiLoCo and local SGD over
# replica groups that may die and rejoin between outer steps (`torchft.local_sgd`), the way runs
# across sites are built.
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
