# %% [markdown]
# # 05 · Model parallelism: one model, split across ranks
#
# Data parallelism copies the whole model onto every worker. When the model does not fit on one
# device, it has to be **split** instead. Model parallelism trains **one** model whose parts live on
# different devices (it does not train separate models):
#
# * **layer-wise** (inter-layer): device 0 holds the first layers, device 1 the next ones. Activations
#   flow forward across the cut, gradients of those activations flow backward;
# * **tensor parallelism** (intra-layer): one layer's weight matrix is split, each device computes its
#   slice of the output;
# * **pipeline parallelism**: layer-wise, fed with **micro-batches**, so that stage 1 works on
#   micro-batch 1 while stage 0 already starts micro-batch 2, shrinking the idle "bubble";
# * **hybrids**: a model-parallel group per node, replicated data-parallel across nodes.
#
# On two ranks: rank 0 is stage 0, rank 1 is stage 1, talking with `send` / `recv`.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## The model and its cut
#
# Six linear layers (4.2 M parameters), cut in the middle into two stages of about the same size.
# The stages are built by a function defined in the notebook, so the notebook can build the
# whole model too and check the split one against it.

# %% tags=["nbval-check-output"]
import torch
import torch.nn.functional as F
import distlab
from distlab import theory
from sklearn.datasets import load_digits

digits = load_digits()
X = torch.tensor(digits.data[:512], dtype=torch.float32) / 16.0    # one batch of 512
Y = torch.tensor(digits.target[:512])
WIDTH = 1024

def make_stage(s):
    """Stage 0: 64 -> 1024 -> 1024 -> 1024; stage 1: 1024 -> 1024 -> 1024 -> 10."""
    torch.manual_seed(s)
    L, R = torch.nn.Linear, torch.nn.ReLU
    if s == 0:
        return torch.nn.Sequential(L(64, WIDTH), R(), L(WIDTH, WIDTH), R(), L(WIDTH, WIDTH), R())
    return torch.nn.Sequential(L(WIDTH, WIDTH), R(), L(WIDTH, WIDTH), R(), L(WIDTH, 10))

lab = distlab.current_lab()
lab.push(X=X, Y=Y, WIDTH=WIDTH, make_stage=make_stage)
print("parameters per stage:", [sum(p.numel() for p in make_stage(s).parameters()) for s in (0, 1)])

# %% [markdown]
# ## One training step through the pipeline
#
# `pipeline_step(stage, m)` runs one batch as `m` micro-batches with the GPipe schedule: all forwards,
# then all backwards. Stage 0 sends each micro-batch's activations to stage 1 (`isend`, so it can start
# the next micro-batch at once). Stage 1 finishes the forward, computes the loss, and in the backward
# sends the gradient of each activation back to stage 0, which continues the backward through its own
# layers. Each rank records when it was computing.

# %%
# %%ddp
import time
import torch.nn.functional as F

def pipeline_step(stage, m):
    stage.zero_grad(set_to_none=True)
    xs, ys = X.chunk(m), Y.chunk(m)
    events, keep = [], []                      # (kind, micro-batch, start, end); tensors in flight
    dist.barrier()
    t0 = time.perf_counter()

    def timed(kind, i, fn):
        a = time.perf_counter()
        out = fn()
        events.append((kind, i, a - t0, time.perf_counter() - t0))
        return out

    if rank == 0:
        outs, sends = [], []
        for i, x in enumerate(xs):
            out = timed("F", i, lambda: stage(x))
            outs.append(out)
            keep.append(out.detach())
            sends.append(dist.isend(keep[-1], dst=1))          # activations forward
        for i in reversed(range(m)):
            grad = torch.empty_like(outs[i])
            dist.recv(grad, src=1)                             # gradient of the activations
            timed("B", i, lambda: outs[i].backward(grad))
    else:
        acts, losses, sends = [], [], []
        for i, y in enumerate(ys):
            act = torch.empty(len(y), WIDTH)
            dist.recv(act, src=0)
            act.requires_grad_()
            losses.append(timed("F", i, lambda: F.cross_entropy(stage(act), y) / m))
            acts.append(act)
        for i in reversed(range(m)):
            timed("B", i, lambda: losses[i].backward())
            sends.append(dist.isend(acts[i].grad, dst=0))      # gradients backward
    for s in sends:
        s.wait()
    total = time.perf_counter() - t0
    return total, sum(e - s for _, _, s, e in events), events

stage = make_stage(rank)
pipeline_step(stage, 1)                                        # warm-up
pipeline_step(stage, 4)
grads = [p.grad.clone() for p in stage.parameters()]

# %% [markdown]
# Is this really one model? Build the whole model in the notebook, run the same batch through it on
# one process, and compare every gradient with the stage that holds it:

# %% tags=["nbval-check-output"]
whole = torch.nn.Sequential(*make_stage(0), *make_stage(1))
F.cross_entropy(whole(X), Y).backward()
split = lab.pull("grads")
mine = split[0] + split[1]
print("gradients from the 2-stage pipeline match the whole model:",
      all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(mine, whole.parameters())))
print("tensors compared:", len(mine))

# %% [markdown]
# ## The bubble
#
# In a pipeline of `p` stages fed `m` micro-batches, stage 1 waits while stage 0 computes the first
# micro-batch, and stage 0 waits while stage 1 turns the last one around. With forward and backward
# times equal across stages, the idle share of a step is
#
# $$\text{bubble} = \frac{p-1}{m+p-1}$$
#
# so more micro-batches shrink it. Measure it: run the step with 1, 2, 4 and 8 micro-batches and
# count, on each rank, the time it was not computing.

# %%
# %%ddp
bubbles = {}
for m in (1, 2, 4, 8):
    runs = [pipeline_step(stage, m) for _ in range(3)]
    total, busy, events = min(runs, key=lambda r: r[0])         # the least disturbed run
    bubbles[m] = (total, busy, events)

# %%
measured = lab.pull("bubbles")
print(f"{'m':>3} {'step':>9} {'idle rank 0':>12} {'idle rank 1':>12} {'theory':>8}")
idle = {}
for m in (1, 2, 4, 8):
    share = [1 - measured[r][m][1] / measured[r][m][0] for r in (0, 1)]
    idle[m] = sum(share) / 2
    print(f"{m:>3} {measured[0][m][0] * 1e3:>7.0f}ms {share[0]:>12.0%} {share[1]:>12.0%} "
          f"{theory.pipeline_bubble_fraction(2, m):>8.0%}")


# %% [markdown]
# The schedule itself, drawn from what the ranks recorded (`F`: forward of a micro-batch, `B`: its
# backward, `.`: waiting). With 4 micro-batches:

# %%
def gantt(m, width=72):
    total = max(measured[r][m][0] for r in (0, 1))
    for r in (0, 1):
        row = ["."] * width
        for kind, i, start, end in measured[r][m][2]:
            a, b = int(start / total * width), max(int(start / total * width) + 1, int(end / total * width))
            row[a:b] = kind * (b - a)
        print(f"stage {r}: {''.join(row)}")

gantt(4)

# %% [markdown]
# Measured idle time includes what the formula leaves out: sending activations, Python overhead per
# micro-batch, stages that are not exactly equal (stage 0 needs no gradient for its input), and the
# other programs sharing this machine's two cores, which interrupt one rank or the other at random.
# Read the table for its trend, which is the formula's from 1 to 4 micro-batches: more micro-batches,
# a smaller bubble. Past that, each micro-batch is so small that fixed costs per micro-batch take over;
# the price of micro-batching is smaller matrices (less efficient compute) and the activations of all
# micro-batches kept until their backward. The formula's numbers, and two worked examples:

# %% tags=["nbval-check-output"]
print("theory, 2 stages:", [round(theory.pipeline_bubble_fraction(2, m), 3) for m in (1, 2, 4, 8)])
print("micro-batches for at most 10% bubble with 4 stages:", theory.micro_batches_for_bubble(4, 0.10))
print("activation sent between stages, micro-batch 8 x sequence 2048 x hidden 4096 in bf16, MB:",
      theory.activation_bytes(8, 2048, 4096) / 1e6)

# %% [markdown]
# ## Tensor parallelism in one layer
#
# Instead of cutting between layers, cut *inside* one: split the weight of a linear layer by output
# columns, `W = [W0 | W1]`. Each rank computes `X @ Wr`, half of the output features, and an
# all-gather puts the halves side by side. (Megatron-LM pairs a column split with a row split in the
# next layer, so that only one all-reduce per pair is needed.)

# %%
# %%ddp
torch.manual_seed(0)
W = torch.randn(64, 512)                       # the full weight, same on every rank for the check
W_mine = W.chunk(world_size, dim=1)[rank]      # this rank's 64 x 256 columns
part = X @ W_mine                              # [512, 256]: half of the output features
parts = [torch.empty_like(part) for _ in range(world_size)]
dist.all_gather(parts, part)
tp_out = torch.cat(parts, dim=1)
tp_ok = torch.allclose(tp_out, X @ W, atol=1e-5)

# %% tags=["nbval-check-output"]
print("column-split layer gives the full layer's output on every rank:", all(lab.pull("tp_ok").values()))

# %% [markdown]
# What each kind of split sends: layer-wise and pipeline parallelism send activations (and their
# gradients) between neighbouring stages only; tensor parallelism needs collectives inside every layer,
# so it is kept within a node on fast links; data parallelism all-reduces gradients once per step.
# Large models combine the three: tensor parallelism within a node, pipeline stages across nodes, and
# the whole arrangement replicated data-parallel.
#
# ## Practice

# %%
# %quiz model-parallelism -n 4

# %%
# %dist stop
