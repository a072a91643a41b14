# %% [markdown]
# # 16 · Pipeline schedules: GPipe, 1F1B and interleaved 1F1B
#
# Notebook 05 cut a model in two and wrote the GPipe schedule by hand with `send` and `recv`. Here
# torch does the sending: `torch.distributed.pipelining` wraps each rank's piece of a model in a
# `PipelineStage`, and a **schedule** decides in which order each stage runs the forwards and
# backwards of the micro-batches. Three of them, on a small GPT cut into stages:
#
# * **GPipe** (Huang et al., 2019): every forward, then every backward. Idle `(p-1)/(m+p-1)` of the
#   time with `p` stages and `m` micro-batches, and every stage keeps the activations of all `m`
#   micro-batches until their backward;
# * **1F1B** (one forward, one backward; PipeDream, Narayanan et al., SOSP 2019, in the synchronous
#   form with a flush at the end of each step that torch runs, PipeDream-Flush, Narayanan et al.
#   2021): a stage starts the backward of a micro-batch as soon as it can, so stage `s` holds at
#   most `p - s` micro-batches' activations. The bubble is the same as GPipe's: 1F1B saves memory,
#   not time;
# * **interleaved 1F1B** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
#   GPU Clusters Using Megatron-LM"): each rank holds `v` smaller pieces ("chunks") of the model
#   instead of one, rank 0 the 1st and 3rd quarters, rank 1 the 2nd and 4th. A micro-batch goes round
#   the ranks `v` times, the pipeline fills `v` times faster, and the bubble is `v` times shorter:
#   `(p-1)/(v·m+p-1)`. The price: `v` times more messages, and more activations in flight.
#
# Then: how much memory each stage really holds, and how much of the CPU's arithmetic the model uses
# (its MFU), alone and as a pipeline.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## The model, whole and in stages
#
# `distlab.nn.GPT`: 8 transformer blocks 256 wide, 4 heads, a character vocabulary, trained on
# sequences of 64 characters of Python's own documentation (shipped with CPython, nothing is
# downloaded). Every rank builds the same model from the same seed, and computes the loss and the
# gradients of the **whole** model on the batch of 16 sequences: the reference each pipeline must
# give again. `pipeline_stages(model, n)` cuts it into `n` stage modules that share the model's
# weights: stage 0 embeds the tokens, the last ends with the head.
#
# Each rank computes on one thread: this machine has two cores, so each rank gets one, as each would
# get a device of its own. The model is large enough that a micro-batch's compute (tens of ms) is far
# longer than sending its activations over loopback, so the schedule's shape shows through.

# %%
# %%ddp
import statistics
import time

import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import distlab.telemetry
from distlab.nn import GPT, CharTokenizer, GPTConfig, corpus, peak_matmul_flops_per_s, pipeline_stages, token_batches

torch.set_num_threads(1)                        # one core per rank, as one device per rank
SEQ, LAYERS, HIDDEN, HEADS, BATCH = 64, 8, 256, 4, 16
text = corpus()
tokenizer = CharTokenizer(text)
config = GPTConfig(vocab_size=tokenizer.vocab_size, seq_len=SEQ, layers=LAYERS, hidden=HIDDEN, heads=HEADS)
x, y = token_batches(tokenizer.encode(text), batch_size=BATCH, seq_len=SEQ,
                     device=device)[0]         # (16, 64) ids, same on every rank
torch.manual_seed(0)
model = GPT(config).to(device)

model.zero_grad(set_to_none=True)
reference_loss = model(x, y)[1]
reference_loss.backward()
reference_grads = {p: p.grad.clone() for p in model.parameters()}     # the whole model's gradients
reference_loss = reference_loss.item()
parameters = sum(p.numel() for p in model.parameters())
vocab = tokenizer.vocab_size


def loss_fn(logits, targets):
    """The schedule's loss of one micro-batch: the model's own cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

# %% [markdown]
# ## A schedule, and a clock on every forward and backward
#
# `make_schedule(kind, m)` cuts the model into 2 stages (4 for interleaved: 2 chunks per rank, rank
# `r` holding stages `r` and `r + 2`), wraps this rank's in `PipelineStage`s and builds torch's
# schedule for `m` micro-batches. Each stage's `forward_one_chunk` and `backward_one_chunk` (what
# the schedule calls to run one micro-batch through a stage) are wrapped to record when they ran: the
# rank is computing inside them, and waiting for a message, sending or idle outside them.
#
# `step(schedule)` runs one training step (forward and backward, no optimizer) between two barriers,
# so both ranks time the same step, and returns the step time, the time this rank computed, the
# events and the loss (on the last stage, the mean of the micro-batches' losses).

# %%
# %%ddp
KINDS = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class Timed:
    """A built schedule, its stages on this rank, and the (stage, F|B, start, end) of each action run."""

    def __init__(self, kind, m):
        chunks = 2 if kind == "interleaved" else 1
        n = world_size * chunks
        self.pieces = pipeline_stages(model, n)
        self.events = []
        self.stages = [self._timed(PipelineStage(self.pieces[i], i, n, device))
                       for i in range(rank, n, world_size)]
        if kind == "interleaved":
            self.schedule = KINDS[kind](self.stages, n_microbatches=m, loss_fn=loss_fn)
        else:
            self.schedule = KINDS[kind](self.stages[0], n_microbatches=m, loss_fn=loss_fn)

    def _timed(self, stage):
        for name, letter in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
            run = getattr(stage, name)

            def timed(*args, _run=run, _letter=letter, _index=stage.stage_index, **kwargs):
                start = time.perf_counter()
                out = _run(*args, **kwargs)
                self.events.append((_index, _letter, start, time.perf_counter()))
                return out

            setattr(stage, name, timed)
        return stage

    def run(self):
        """One step: rank 0 feeds the tokens, the last rank the targets."""
        losses = []
        self.schedule.step(*((x,) if rank == 0 else ()), target=y if rank == world_size - 1 else None,
                           losses=losses)
        return losses


def step(timed):
    model.zero_grad(set_to_none=True)
    timed.events.clear()
    dist.barrier()
    t0 = time.perf_counter()
    losses = timed.run()
    dist.barrier()                                  # the step ends when both ranks are done
    total = time.perf_counter() - t0
    events = [(s, kind, a - t0, b - t0) for s, kind, a, b in timed.events]
    busy = sum(b - a for _, _, a, b in events)
    loss = torch.stack(losses).mean().item() if losses else None
    return total, busy, events, loss

# %% [markdown]
# Is it still one model? One step of each schedule with 4 micro-batches: the last rank's loss must be
# the whole model's, and every gradient a rank holds (of its own stages) must be the whole model's.

# %%
# %%ddp
schedules = {(kind, m): Timed(kind, m) for kind in KINDS for m in (2, 4, 8)}
same = {}
for kind in KINDS:
    _, _, _, loss = step(schedules[kind, 4])
    mine = [p for piece in schedules[kind, 4].pieces for p in piece.parameters() if p.grad is not None]
    same[kind] = {
        "loss": None if loss is None else abs(loss - reference_loss) < 1e-5,
        "grads": all(torch.allclose(p.grad, reference_grads[p], rtol=1e-4, atol=1e-6) for p in mine),
        "tensors": len(mine),
    }

# %% tags=["nbval-check-output"]
import statistics

import distlab
from distlab import theory

lab = distlab.current_lab()
checks = lab.pull("same")
for kind in ("gpipe", "1f1b", "interleaved"):
    print(f"{kind:>11}: loss matches the whole model: {checks[1][kind]['loss']}; gradients match on both ranks: "
          f"{checks[0][kind]['grads'] and checks[1][kind]['grads']} "
          f"({checks[0][kind]['tensors']} + {checks[1][kind]['tensors']} tensors)")

# %% [markdown]
# ## The order each stage runs
#
# `theory.pipeline_schedule` gives the order torch runs each stage's actions in (`F2`: forward of
# micro-batch 2, `B2` its backward; interleaved, `2F1` is stage 2's forward of micro-batch 1). With 2
# stages and 4 micro-batches: GPipe runs all its forwards first; 1F1B's stage 0 runs `p - 0 = 2`
# forwards, then alternates; interleaved, each rank runs its two chunks in turn.

# %%
for kind in ("gpipe", "1f1b", "interleaved"):
    order = theory.pipeline_schedule(2, 4, kind, chunks=2 if kind == "interleaved" else 1)
    for r, actions in enumerate(order):
        print(f"{kind:>11} rank {r}: {' '.join(actions)}")

# %% [markdown]
# ## The bubble, predicted then measured
#
# With `p = 2` ranks and `v = 2` chunks, theory gives a bubble of `(p-1)/(m+p-1)` for GPipe and 1F1B,
# and `(p-1)/(v·m+p-1)` interleaved (`theory.bubble_fraction`). Predict first:

# %%
from distlab.quiz import predict

guess = predict("Two ranks, interleaved 1F1B with 2 chunks per rank, 4 micro-batches: what share of the step "
                "will a rank sit idle?", theory="bubble_fraction", unit="%", tolerance=0.25,
                stages=2, micro_batches=4, schedule="interleaved", chunks=2)
guess

# %% [markdown]
# Now measure: each schedule with 2, 4 and 8 micro-batches, one warm-up step each, then 5 rounds of
# all nine (interleaved, so a burst of load on the machine hits all of them alike). A rank's idle
# share is `1 - busy / step time`, busy being its timed forwards and backwards.

# %%
# %%ddp
for timed in schedules.values():
    step(timed)                                     # warm-up: buffers, shapes
runs = {key: [] for key in schedules}
for repeat in range(5):
    for key, timed in schedules.items():
        runs[key].append(step(timed)[:3])           # (step time, busy, events)

# %%
measured = lab.pull("runs")
KINDS, MS = ("gpipe", "1f1b", "interleaved"), (2, 4, 8)


def idle_share(key, k):
    """Repeat k: the share of the step the two ranks were not computing, averaged over the ranks."""
    return sum(1 - measured[r][key][k][1] / measured[r][key][k][0] for r in (0, 1)) / 2


def median_repeat(key):
    repeats = sorted(range(len(measured[0][key])), key=lambda k: idle_share(key, k))
    return repeats[len(repeats) // 2]


def bubble(kind, m):
    return theory.bubble_fraction(2, m, kind, chunks=2 if kind == "interleaved" else 1)


idle = {key: idle_share(key, median_repeat(key)) for key in measured[0]}
step_s = {key: statistics.median(t for t, _, _ in measured[0][key]) for key in measured[0]}
print(f"{'schedule':>11} {'m':>2} {'step':>7} {'idle':>6} {'(min-max of 5)':>15} {'theory':>7} {'measured - theory':>18}")
for kind in KINDS:
    for m in MS:
        spread = [idle_share((kind, m), k) for k in range(len(measured[0][kind, m]))]
        print(f"{kind:>11} {m:>2} {step_s[kind, m] * 1e3:>5.0f}ms {idle[kind, m]:>6.1%} "
              f"({min(spread):>5.1%}-{max(spread):>5.1%}) {bubble(kind, m):>7.1%} "
              f"{(idle[kind, m] - bubble(kind, m)) * 100:>+15.1f} pt")

# %%
guess.reveal(idle["interleaved", 4])

# %% [markdown]
# ### The timeline, theory beside the run
#
# `theory.pipeline_timeline` places each action of torch's order as soon as its stage is free and its
# input has arrived, with every forward taking `f` and every backward `b` (per micro-batch and rank,
# `f/v` and `b/v` per chunk), and messages free. Here `f` and `b` are the medians this run measured
# with 1F1B. Each row is a rank, 4 micro-batches: `F`/`B` a forward or backward of the first chunk,
# `f`/`b` of the second (interleaved), `.` idle.

# %%
def f_and_b(key):
    """Median forward and backward time of one micro-batch through one rank (all its chunks)."""
    chunks = 2 if key[0] == "interleaved" else 1
    k = median_repeat(key)
    per = {kind: [b - a for r in (0, 1) for _, kd, a, b in measured[r][key][k][2] if kd == kind] for kind in "FB"}
    return statistics.median(per["F"]) * chunks, statistics.median(per["B"]) * chunks


def draw(rows, total, width=78):
    """rows: per rank, (global stage, F|B, start, end); chunk 2 in lower case."""
    for r, actions in enumerate(rows):
        line = ["."] * width
        for stage, kind, start, end in actions:
            a = min(width - 1, int(start / total * width))
            b = max(a + 1, int(end / total * width))
            line[a:b] = (kind if stage < 2 else kind.lower()) * (b - a)
        print(f"  rank {r}: {''.join(line[:width])}")


f, b = f_and_b(("1f1b", 4))
print(f"measured per micro-batch and rank: forward {f * 1e3:.1f} ms, backward {b * 1e3:.1f} ms")
for kind in KINDS:
    chunks = 2 if kind == "interleaved" else 1
    timeline = theory.pipeline_timeline(2, 4, f, b, kind, chunks=chunks)
    rows = []
    for r, actions in enumerate(timeline):
        rows.append([])
        for action, start, end in actions:
            letter = "F" if "F" in action else "B"
            stage = int(action.split(letter)[0]) if kind == "interleaved" else r
            rows[-1].append((stage, letter, start, end))
    k = median_repeat((kind, 4))
    run_total = measured[0][kind, 4][k][0]
    total = max(run_total, timeline[0][-1][2], timeline[1][-1][2])
    predicted = theory.pipeline_step_time_s(2, 4, f, b, kind, chunks=chunks)
    print(f"{kind}: theory {predicted * 1e3:.0f} ms")
    draw(rows, total)
    print(f"{kind}: measured {run_total * 1e3:.0f} ms")
    draw([measured[r][kind, 4][k][2] for r in (0, 1)], total)

# %% [markdown]
# What the runs made while writing this lab showed (4 runs of the notebook, medians of 5 repeats):
#
# * the idle share falls as `m` grows, for every schedule, as `(p-1)/(m+p-1)` says;
# * GPipe and 1F1B idle about as much as each other (30-35% at `m = 2`): 1F1B reorders the work, it
#   does not remove any waiting. In the saved run GPipe idles 2 to 3.5 points more at every `m`, inside
#   the two schedules' overlapping min-max: a difference these runs cannot tell from noise, so it is
#   not explained here;
# * interleaving cuts the bubble most where it is largest, at small `m`: with 2 micro-batches, 22-25%
#   idle against 30-35% for 1F1B;
# * the measurement stays near theory at `m = 2` (from 3 points below to 5 above) and above it as `m`
#   grows (5 to 12 points at `m = 8`). Theory assumes free messages and equal stages. Each
#   micro-batch costs every rank a send, a receive and the time to wake up when its message arrives,
#   and every action is smaller; the two stages are not equal either (stage 0 embeds the tokens,
#   stage 1 computes the head and the loss). Interleaving pays the messages twice per micro-batch (2
#   chunks), which is why its advantage shrinks at `m = 8`, where the theoretical bubble is only 6%.
#   On a GPU cluster the same trade-off decides whether interleaving pays: Megatron-LM uses it when
#   the bubble is large and the links are fast.
#
# The checks below hold the two effects of the theory that are far larger than the spread of the
# repeats (the table's min-max, a few points): the bubble at `m = 2` against `m = 8` (22 points apart in
# theory for GPipe and 1F1B, 12 to 18 measured) and interleaved against 1F1B at `m = 2` (13 points in
# theory, 8 to 10 measured). Each compares the two settings round by round (they ran one after the
# other in every round) and takes the median of the 5 rounds, so load on the machine that slows a round
# slows both sides of its comparison. How far the measurement sits from theory is shown above, not
# checked: it grows with the messages' cost, which other work on the cores raises (interleaved's own
# shrinking from `m = 2` to `m = 8`, 7 points measured, is within that reach too).
#
# Interleaving's gain needs each stage on a device of its own (here a core each, as notebook 05 asks).
# Where the two stages share one (one core, as Binder gives; one GPU that both ranks use, as on a
# single-GPU machine) they take turns on it, and what is measured is no longer the bubble alone: on
# an H200 shared by the two ranks, interleaved idled no less than 1F1B at `m = 2`. The cell below says
# which case this is, and the second check is left out where the stages share a device.

# %%
# The cores the ranks may run on (their affinity), and their devices:
cores = len(set().union(*lab.run("import os; os.sched_getaffinity(0)", stream=False).values()))
devices = {rank.device for rank in lab.status()}
own_devices = len(devices) == 2 if any(d.startswith("cuda") for d in devices) else cores >= 2
print("each stage has a device of its own" if own_devices else
      f"the 2 stages share {'one GPU' if 'cuda' in ''.join(devices) else 'one core'} here: they take turns "
      "on it, so interleaved against 1F1B is not checked")

# %% tags=["nbval-check-output"]
def median_gap(more, less):
    """The median over the rounds of idle(more) - idle(less), the two measured in the same round."""
    return statistics.median(idle_share(more, k) - idle_share(less, k) for k in range(len(measured[0][more])))


print("the bubble shrinks from m = 2 to m = 8 with GPipe and with 1F1B, round by round:",
      all(median_gap((kind, 2), (kind, 8)) > 0 for kind in ("gpipe", "1f1b")))
print("interleaved idles less than 1F1B at m = 2, round by round, where each stage has a device:",
      not own_devices or median_gap(("1f1b", 2), ("interleaved", 2)) > 0)

# %% [markdown]
# ## Memory: what each stage holds at its peak
#
# GPipe keeps every micro-batch's activations until the backward phase starts: `m` of them. 1F1B
# starts backwards early, so stage `s` keeps at most `p - s`: 2 on stage 0, 1 on stage 1
# (`theory.in_flight_micro_batches`). Interleaved keeps more than 1F1B (its warm-up runs more
# forwards), each a chunk's worth.
#
# `distlab.telemetry.track_memory()` counts the bytes of the tensors made inside a block that are
# alive at once. First, one micro-batch's activations on each rank (the forward of its stage on 2
# sequences, what stays alive for the backward), then the peak of a whole step with `m = 8`. The
# gradients already exist (from the steps above) and are added into, so the peak is activations and
# the backward's temporaries.

# %%
# %%ddp
piece = pipeline_stages(model, 2)[rank]
micro_batch = BATCH // 8
g = torch.Generator().manual_seed(1)
inputs = (x[:micro_batch] if rank == 0
          else torch.randn(micro_batch, SEQ, HIDDEN, generator=g).to(device).requires_grad_())   # CPU generator, moved
with distlab.telemetry.track_memory() as one:
    out = piece(inputs)
activation_bytes = one.retained_bytes           # what one micro-batch leaves alive for its backward
del out, inputs
peaks = {}
for kind in KINDS:
    timed = schedules[kind, 8]
    step(timed)                                 # the gradients exist: the tracked step adds into them
    dist.barrier()
    with distlab.telemetry.track_memory() as use:
        timed.run()
    peaks[kind] = use.peak_bytes
    dist.barrier()

# %%
act = lab.pull("activation_bytes")
peaks = lab.pull("peaks")
print(f"one micro-batch's activations: rank 0 {act[0] / 2**20:.1f} MiB, rank 1 {act[1] / 2**20:.1f} MiB")
print(f"{'schedule':>11} {'rank':>4} {'peak':>9} {'peak / activations':>19} {'theory in flight':>17}")
for kind in KINDS:
    for r in (0, 1):
        flight = theory.in_flight_micro_batches(r, 2, 8, kind, chunks=2 if kind == "interleaved" else 1)
        print(f"{kind:>11} {r:>4} {peaks[r][kind] / 2**20:>5.1f} MiB {peaks[r][kind] / act[r]:>19.1f} {flight:>17.1f}")
ratio = {r: peaks[r]["gpipe"] / peaks[r]["1f1b"] for r in (0, 1)}
ratio_theory = {r: theory.in_flight_micro_batches(r, 2, 8, "gpipe") / theory.in_flight_micro_batches(r, 2, 8, "1f1b")
                for r in (0, 1)}
for r in (0, 1):
    print(f"rank {r}: GPipe / 1F1B peak, measured {ratio[r]:.2f}, theory {ratio_theory[r]:.0f}")

# %% [markdown]
# The peaks follow the count of micro-batches in flight, plus a little (about a fifth of a
# micro-batch's worth in the runs made while writing this lab): the backward's own temporaries, such as
# the gradient flowing back through a block, or a layer's gradients before they are added into `.grad`.
# That constant keeps the measured ratio a little below theory's 4 (stage 0: 8 in flight against 2)
# and 8 (stage 1: 8 against 1). Interleaved holds more than 1F1B, since its warm-up runs extra
# forwards, each of them a chunk's worth (half of the rank's layers). At real sizes 1F1B's saving is
# what lets a pipeline use many micro-batches (a small bubble) without running out of memory.

# %% tags=["nbval-check-output"]
print("1F1B holds less than GPipe on both ranks:", all(peaks[r]["1f1b"] < peaks[r]["gpipe"] for r in (0, 1)))
print("the last stage saves more than the first (1 in flight against 2):", ratio[1] > ratio[0])
print("GPipe / 1F1B measured between 60% and 110% of theory's ratio on both ranks:",
      all(0.6 * ratio_theory[r] < ratio[r] < 1.1 * ratio_theory[r] for r in (0, 1)))

# %% [markdown]
# ## Tokens per second, and the model FLOPs utilisation
#
# Training costs about `6N` FLOPs per token for `N` parameters, plus `12·layers·h·s` for the attention
# scores (Kaplan et al., 2020; PaLM, Chowdhery et al., 2022): `theory.training_flops_per_token`. The
# **MFU** is the model FLOPs achieved per second over the peak of the hardware. A CPU has no
# datasheet peak to trust, so each rank measures its own with `peak_matmul_flops_per_s()`: the best
# rate of square matmuls (256, 512 and 1024 rows, since a CPU's best size depends on its caches) on
# its one thread, measured on both ranks at once (they share the machine's memory and caches, as in
# the runs). It is measured between the timed steps, not once before them: a neighbour that steals
# the core for a moment then lowers one measurement, not the peak.
#
# The single-process model: each rank trains the whole model on the whole batch (forward and
# backward), both at the same time, so each runs as one device would, beside a busy neighbour.

# %%
# %%ddp
peak_flops = 0.0
alone = []
for _ in range(4):
    peak_flops = max(peak_flops, *(peak_matmul_flops_per_s(size=size, repeats=3, device=device)
                                   for size in (256, 512, 1024)))
    model.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    model(x, y)[1].backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)          # CUDA runs asynchronously: time the step, not its launch
    alone.append(time.perf_counter() - start)
alone_s = statistics.median(alone[1:])         # the first is a warm-up

# %%
shape = theory.TransformerShape(layers=8, hidden=256, heads=4, seq_len=64, vocab=lab.pull("vocab")[0],
                                tied_embeddings=False)
flops_per_token = theory.training_flops_per_token(shape)
peak = lab.pull("peak_flops")
tokens = 16 * 64
print(f"parameters: {shape.parameters():,} (the model has {lab.pull('parameters')[0]:,}); "
      f"{flops_per_token / 1e6:.1f} MFLOP per token trained")
print(f"peak matmul rate: rank 0 {peak[0] / 1e9:.0f} GFLOP/s, rank 1 {peak[1] / 1e9:.0f} GFLOP/s")
rate_alone = tokens / statistics.mean(lab.pull("alone_s").values())
mfu_alone = theory.model_flops_utilization(rate_alone, flops_per_token, statistics.mean(peak.values()))
print(f"{'':>24} {'tokens/s':>9} {'MFU':>6}")
print(f"{'one process, one core':>24} {rate_alone:>9.0f} {mfu_alone:>6.1%}")
mfu = {}
for kind in KINDS:
    for m in (2, 8):
        rate = tokens / step_s[kind, m]
        mfu[kind, m] = theory.model_flops_utilization(rate, flops_per_token, sum(peak.values()))
        print(f"{kind + f', m = {m}, 2 cores':>24} {rate:>9.0f} {mfu[kind, m]:>6.1%}")
busy = statistics.mean(statistics.median(b for _, b, _ in measured[r]["1f1b", 8]) for r in (0, 1))
print(f"compute per rank in a 1F1B step (m = 8): {busy * 1e3:.0f} ms, against half of one process's step: "
      f"{statistics.mean(lab.pull('alone_s').values()) / 2 * 1e3:.0f} ms")

# %% [markdown]
# Why these numbers:
#
# * **one process** reaches a large share of the matmul peak, because almost all of a transformer's
#   FLOPs are matmuls, and on a CPU a matmul of a few hundred rows runs nearly as fast as the
#   1024 x 1024 of the peak. What it loses is the work that counts no FLOPs in `6N`: LayerNorm,
#   GELU, softmax and the adds read and write memory, and each op costs Python and dispatch time;
# * **the pipeline** loses more (in the runs made while writing this lab, 50 to 56% against 73% for
#   one process on a quiet machine, 25 to 31% against 33% on one busy with other work): the bubble (the table above), the sends and receives, and the smaller matmuls of
#   the micro-batches (2 sequences each at `m = 8`), whose fixed cost per op is paid 8 times: a rank
#   computes longer than half of the single process's step (the last line). It still trains faster
#   than one core, since two cores work at once most of the time, but each core is used less. The two
#   ranks also share this machine's memory bus and caches, and any other process on it takes cores
#   from them: on 2 shared cores, the timings move by several percent from run to run, and the single
#   process and the pipelines are timed one after the other, not in the same rounds, so a neighbour
#   busy during one of them (a build, a test run) can reverse the comparison. It is a measurement to
#   read, not a check this notebook holds.
#
# On a GPU the single-process MFU is much lower than here (30 to 50% is good for large models:
# kernels launch, memory-bound ops and communication leave the tensor cores idle), and the pipeline
# is there because the model does not fit, not to go faster.

# %% tags=["nbval-check-output"]
print("MFU is a fraction between 0 and 1, alone and for every schedule:",
      all(0 < value < 1 for value in (mfu_alone, *mfu.values())))

# %% [markdown]
# ## Practice
#
# One of the questions runs a small pipeline on your ranks. It is checked here against torch's
# schedule on this lab: the number of forwards rank 0 runs before its first backward, for GPipe and
# 1F1B.

# %% tags=["nbval-check-output"]
from distlab import quiz

question = quiz.bank().get("model-parallelism/live-forwards-before-backward")
for kind in ("gpipe", "1f1b"):
    attempt = question.draw(lab=lab, params={"schedule": kind, "micro_batches": 6})
    expected = theory.pipeline_schedule(2, 6, kind)[0].index("B0")
    print(f"{kind}: the lab's answer {attempt.answer()} is theory's {expected}:", attempt.answer() == expected)

# %%
# %quiz model-parallelism -n 4

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise pipeline-1f1b`: a 1F1B schedule for 2 stages from `send` and `recv`, its order checked against torch's and its gradients against the whole model.

# %%
# %dist stop
