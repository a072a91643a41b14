# %% [markdown]
# # 11 · Scaling: what a second rank buys, and what N ranks would
#
# Why distribute at all? Because a model's parameters and training state can outgrow one device's
# memory (tens of GB per GPU), because a data set of millions or billions of examples takes too long
# to go through on one device, because faster iterations mean more experiments, and because many
# cheaper devices can beat one expensive one. And when not to: a small model on a small data set
# spends more time talking than computing, and a single device is faster.
#
# Training time grows **linearly with the number of batches**. Adding workers divides the
# computation, but not the communication and the waiting: the speed-up is less than the number of
# workers. This lab measures both, going from 1 to 2 ranks, and then uses the cost model to predict N.
#
# Three measures:
#
# * **speed-up** S(N) = T(1) / T(N) for the **same total work** (*strong scaling*): how many times
#   faster N workers finish the same job;
# * **efficiency** E(N) = S(N) / N: 1.0 is perfect strong scaling;
# * **weak-scaling efficiency** T(1) / T(N) when each of the N workers does as much work as the one
#   did (N times the work in all): 1.0 means the extra workers cost nothing. This ratio is not a
#   speed-up: the two runs did different amounts of work.

# %% [markdown]
# ## The job
#
# Steps of SGD on a **global batch of 2,048** digits (the 1,797 of the data set, taken round in a
# shuffled order), with an MLP of 1.1 M parameters. On 2 ranks each takes half of every batch, so the
# total work stays the same. Each rank computes on one thread and this machine has two cores: with 2
# ranks, each has a core of its own, as each would have a device of its own.
#
# The training function is defined in the notebook and pushed to the ranks. `alone=True` runs it on
# one rank as a single device would: the plain model, no DDP, nothing to all-reduce. `per_rank` sets
# each rank's share of a step (by default its share of the global batch), and `watch=True` runs it
# under `distlab.watch` (for the dashboard; the timed runs are not watched, since watching costs a
# little time).

# %%
import statistics

import torch
import distlab
from distlab import theory
from sklearn.datasets import load_digits

digits = load_digits()
GLOBAL_BATCH = 2048

def train(steps, device, per_rank=None, alone=False, watch=False):
    """`steps` steps, `per_rank` samples per rank each, on `device` (the rank's: a pushed function does
    not see the rank's names, so each call passes it).

    Returns (seconds, final weights, median exposed all-reduce if watched, seconds after each step)."""
    import statistics
    import time
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)                       # one core per rank
    rank, world = (0, 1) if alone else (dist.get_rank(), dist.get_world_size())
    per_rank = per_rank or GLOBAL_BATCH // world
    def synchronize():                             # CUDA runs asynchronously: wait for it before reading the clock
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    X = torch.tensor(digits.data, dtype=torch.float32, device=device) / 16.0
    Y = torch.tensor(digits.target, device=device)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).to(device)
    model = net if alone else DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    order = torch.randperm(len(Y), generator=torch.Generator().manual_seed(1)).to(device)
    w = distlab.watch(model) if watch else None
    if not alone:
        dist.barrier()
    synchronize()
    t0 = time.perf_counter()
    marks = []
    for step in range(steps):
        batch = per_rank * world
        rows = order[torch.arange(step * batch, (step + 1) * batch, device=device) % len(Y)]
        rows = rows[rank::world]                   # this rank's share of the step's batch
        loss = F.cross_entropy(model(X[rows]), Y[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if w:
            distlab.log(loss=loss)
        synchronize()
        marks.append(time.perf_counter() - t0)
    if not alone:
        dist.barrier()
    synchronize()
    elapsed = time.perf_counter() - t0
    exposed = None
    if w:
        exposed = statistics.median(r["comm_s"] for r in w.records()[1:])
        w.close()
    return elapsed, [p.detach().cpu().clone() for p in net.parameters()], exposed, marks   # CPU: for the notebook


# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## One rank against two, interleaved
#
# The job is 16 steps on the global batch of 2,048. Four runs, repeated in turn, so that whatever else
# this machine is doing weighs on all of them alike:
#
# * **one rank**, rank 0 alone (rank 1 waits): 32 steps, with the time noted after each one, so that
#   T(k), the time of the first k batches, can be read for k = 4, 8, 16 and 32 (is it linear in k?);
#   T(16) is T(1) of the scaling measurement;
# * **two ranks**, the same 16 steps, 1,024 samples each: T(2);
# * **one rank** again, 16 steps of 1,024 samples, the share each of 2 ranks takes: T(1) for weak
#   scaling;
# * **two ranks each alone**: both compute their 1,024 samples at the same time, without
#   communicating, to see what computing side by side costs on this machine.
#
# The machine is shared, and a run can only be slowed by what else runs, never sped up: each time
# kept is the **fastest of the repeats** (five for T(1) and T(2), three for the others), with the
# spread shown beside it.
#
# First a warm-up on each (the first steps pay one-off costs), and a quick all-reduce sweep, fitted to
# the ring model (latency `a`, bandwidth `B`) as in notebook 03, for the cost model.

# %%
lab = distlab.current_lab()
lab.push(train=train, digits=digits, GLOBAL_BATCH=GLOBAL_BATCH)
weights = lab.run("train(2, device, alone=True)", ranks=0, stream=False)[0][1]
lab.run("train(2, device)", stream=False)
grad_bytes = sum(p.numel() for p in weights) * 4       # float32 gradients, one per parameter

# %%
# %%ddp
import time
sweep = []
for size in (1 << 16, 1 << 20, 4 << 20, 16 << 20):
    buf = torch.ones(size // 4, device=device)
    runs = []
    for _ in range(7):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)      # CUDA runs asynchronously: time the all-reduce, not its launch
        runs.append(time.perf_counter() - t0)
    sweep.append((size, sorted(runs)[3]))

# %% [markdown]
# The cost model for 2 ranks: each computes half of the step, then they all-reduce the gradients:
# `T(2) = T(1)/2 + all-reduce` per step. (DDP starts an all-reduce as soon as a bucket of gradients is
# ready; here the middle layer's, 4.2 of the 4.5 MB, are ready only when the backward has one small
# layer left, so almost nothing overlaps.) The compute per step is measured on one rank (a short run
# here; the timed runs come after), the all-reduce comes from the sweep. Predict the speed-up before
# measuring it:

# %%
from distlab.quiz import predict

link = theory.fit_latency_bandwidth(lab.pull("sweep", ranks=0)[0], workers=2)
comm = link.allreduce_time_s(grad_bytes, 2)
alone = lab.run("train(16, device, alone=True)", ranks=0, stream=False)[0]        # also the weights of the job
compute_1, w1 = alone[0] / 16, alone[1]
print(f"link: a = {link.latency_s * 1e6:.0f} us, B = {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s; "
      f"all-reduce of the {grad_bytes / 1e6:.1f} MB of gradients: {comm * 1e3:.1f} ms; "
      f"compute on 1 rank: {compute_1 * 1e3:.0f} ms per step")
guess = predict(f"One rank computes a step in {compute_1 * 1e3:.0f} ms; the all-reduce of the gradients costs "
                f"{comm * 1e3:.1f} ms on this link. What speed-up T(1)/T(2) will 2 ranks reach on the same job?",
                theory="strong_scaling_speedup", unit="x", tolerance=0.1,
                compute_time_one_worker_s=compute_1, comm_time_s=comm, workers=2)
guess

# %%
JOB, STEPS = 16, (4, 8, 16, 32)
one, one_weak, two, side_by_side = [], [], [], []
for repeat in range(5):
    one.append(lab.run("train(32, device, alone=True)", ranks=0, stream=False)[0][3])     # seconds after each step
    two.append(lab.run(f"train({JOB}, device)", stream=False)[0])
    if repeat < 3:
        one_weak.append(lab.run(f"train({JOB}, device, per_rank=1024, alone=True)", ranks=0, stream=False)[0][0])
        both = lab.run(f"train({JOB}, device, per_rank=1024, alone=True)", stream=False)
        side_by_side.append(max(both[0][0], both[1][0]))

def spread(times):
    return f"{min(times):.3f}s ({statistics.median(times):.3f}-{max(times):.3f}s)"

# %% [markdown]
# ### Time against the number of batches
#
# If time is linear in the number of batches, the T(k) lie on a line `T(k) = c + k x step`: fit the
# line (least squares), and look at what is left over. (`c` is what a run costs besides its steps:
# nothing much here, since the clock starts at the first step; the fit puts it within a step of zero,
# either side.)

# %%
T = {k: min(marks[k - 1] for marks in one) for k in STEPS}
k_mean, t_mean = sum(STEPS) / len(STEPS), sum(T.values()) / len(STEPS)
step_s = sum((k - k_mean) * (T[k] - t_mean) for k in STEPS) / sum((k - k_mean) ** 2 for k in STEPS)
fixed_s = t_mean - step_s * k_mean
line = {k: fixed_s + k * step_s for k in STEPS}
print(f"{'steps':>6} {'T(k), fastest (median-max)':>27} {'the line':>9} {'residual':>9}")
for k in STEPS:
    print(f"{k:>6} {spread([marks[k - 1] for marks in one]):>27} {line[k]:>8.3f}s {(T[k] - line[k]) / T[k]:>+9.1%}")
print(f"the line: T(k) = {fixed_s * 1e3:.0f} ms + k x {step_s * 1e3:.1f} ms; "
      f"theory.training_time_s(1000, step) = {theory.training_time_s(1000, step_s):.0f} s for 1,000 batches")

# %% [markdown]
# On a quiet machine every T(k) lies within a few percent of the line (at most 2.2% to 4.3% in the
# runs made while writing this lab). The residuals are shown, not checked: other work that comes and goes on the
# machine (on 2 shared cores, anything else running) can slow every repeat of one k and spare another,
# and the fastest of five no longer lands on the line (8% off in a run beside a test suite).

# %%
print(f"largest residual from the line: {max(abs(T[k] - line[k]) / T[k] for k in STEPS):.1%}")

# %% [markdown]
# ### Speed-up, efficiency, weak scaling

# %%
t1, t1_weak = T[JOB], min(one_weak)
t2 = min(r[0] for r in two)
w2 = two[0][1]
speedup = theory.speedup(t1, t2)
predicted = theory.strong_scaling_speedup(t1 / JOB, comm, 2)
weak = theory.weak_scaling_efficiency(t1_weak, t2)
weak_predicted = theory.expected_scaling_efficiency(t1_weak / JOB, comm)
print(f"1 rank, {JOB} steps of 2,048: {spread([marks[JOB - 1] for marks in one])}; of 1,024: {spread(one_weak)}")
print(f"2 ranks, {JOB} steps of 2,048 (1,024 each): {spread([r[0] for r in two])}")
print(f"strong scaling: speed-up {speedup:.2f} (model {predicted:.2f}, measured/model {speedup / predicted:.2f}), "
      f"efficiency {theory.parallel_efficiency(t1, t2, 2):.0%}")
print(f"weak scaling: efficiency T(1)/T(2) = {weak:.0%} (model {weak_predicted:.0%})")

# %%
guess.reveal(speedup)

# %% [markdown]
# (The model in the table takes the compute per step from the timed 1-rank runs above; the prediction
# you made had only the short run before it. The two differ by what the machine's speed did between
# them, in the second digit here.)
#
# Two ranks finish the same job in less time, but not in half of it. The model accounts for part of
# the gap, the all-reduce. Two sources it leaves out can be measured, and the last line below says how
# much of what is left they explain in this run (in the runs made while writing this lab, from half of
# it to somewhat more than all of it: both move with the machine's load, and the two-rank step was
# not measured in the same moments as they were):
#
# * **computing side by side**: two ranks computing at the same time on this machine share its caches
#   and memory bus (devices of their own would not): compare the compute of 1,024 samples on one rank
#   alone with the same on both ranks at once;
# * **the all-reduce in a step** costs more than in the sweep, where both ranks start it at the same
#   moment (after a barrier) on buffers they have reused: in a training step, DDP first copies the
#   gradients into its bucket, and a rank that finishes its backward first waits for the other. A
#   watched run measures it as the steps saw it (`comm_s` of each step's record: the wait after the
#   backward).

# %%
watched = lab.run(f"train({JOB}, device, watch=True)", stream=False)
exposed = statistics.median(watched[r][2] for r in (0, 1))
alone_step, together_step = t1_weak / JOB, min(side_by_side) / JOB
print(f"compute of 1,024 samples per step: {alone_step * 1e3:.0f} ms alone, {together_step * 1e3:.0f} ms "
      f"with both ranks computing ({together_step / alone_step - 1:+.0%})")
print(f"all-reduce in a step: {exposed * 1e3:.1f} ms (sweep model: {comm * 1e3:.1f} ms)")
model_step, both = t1 / JOB / 2 + comm, together_step + exposed
print(f"step on 2 ranks: measured {t2 / JOB * 1e3:.0f} ms; cost model {model_step * 1e3:.0f} ms; "
      f"with both measured effects {both * 1e3:.0f} ms")
print(f"of the {(t2 / JOB - model_step) * 1e3:.0f} ms the cost model leaves unexplained, the two effects "
      f"explain {(both - model_step) * 1e3:.0f} ms")

# %% [markdown]
# The dashboard shows that watched run. Look at the share of each step spent in the all-reduce, and at
# which rank the other waited for:

# %%
lab.dashboard()

# %% [markdown]
# What the check below holds to: the 2 ranks trained the same model as 1 rank (the same global batch,
# so the same job, up to float rounding since the sum is taken in a different order).
#
# The speed-up is printed above, not checked. In the runs made while writing this lab on a quiet
# 2-core machine it was 1.4 to 1.6, 78-91% of the cost model's, which leaves out the two effects just
# measured and so is an upper bound there. On a loaded machine the speed-up drops first: one rank alone
# has the second core to absorb whatever else runs, two ranks have none. With one other busy process,
# the single rank still has a core of its own while the two ranks share two cores three ways, and the
# speed-up can fall to about 1; and load that comes and goes can spare the two-rank runs and slow the
# one-rank runs, which pushes the measurement up to the model and past it. The weak-scaling efficiency
# is printed, not checked either: on a quiet machine it also pays for the two ranks computing side by
# side (measured above), which the model, counting only communication, leaves out, and with a device
# per rank it would come closer to the model's; beside other work it can even come out above 100%, for
# the same reason as the speed-up.

# %% tags=["nbval-check-output"]
print("2 ranks trained the same model as 1 rank:",
      all(torch.allclose(a, b, atol=1e-5) for a, b in zip(w1, w2)))

# %% [markdown]
# ## From 2 to N, with the cost model
#
# What would 4, 8 or 64 ranks do? Split the step into its parts and scale each, as if every rank had
# a device of its own and the ranks were joined by links like the one just measured:
#
# * compute per rank shrinks as 1/N in strong scaling (each rank gets 1/N of the global batch), and
#   stays the same in weak scaling (each rank keeps its 1,024 samples);
# * the ring all-reduce of the S bytes of gradients costs `2(N-1)/N * S/B + 2(N-1)a`, the same in both,
#   and it *grows* with N: its bandwidth term towards `2S/B`, its latency term without bound.

# %%
print(f"{'N':>4} {'compute':>9} {'all-reduce':>11} {'step':>9} {'speed-up':>9} {'efficiency':>11} "
      f"{'weak-scaling efficiency':>24}")
for n in (1, 2, 4, 8, 16, 64):
    allreduce = link.allreduce_time_s(grad_bytes, n)
    step = t1 / JOB / n + allreduce                    # no overlap: a pessimistic model
    s = theory.strong_scaling_speedup(t1 / JOB, allreduce, n)
    print(f"{n:>4} {t1 / JOB / n * 1e3:>7.1f}ms {allreduce * 1e3:>9.1f}ms {step * 1e3:>7.1f}ms "
          f"{s:>9.2f} {s / n:>11.0%} {theory.expected_scaling_efficiency(t1_weak / JOB, allreduce):>24.0%}")

# %% [markdown]
# In strong scaling the speed-up flattens and then falls: past some N, adding ranks shrinks the part
# that was already small and leaves the all-reduce, which does not shrink. Weak scaling holds up much
# better, since each rank keeps its compute, but not perfectly: its efficiency is
# compute / (compute + communication(N)), and the communication per step grows with N (the ring's
# `2(N-1)/N` factor, the latency term `2(N-1)a`). Three levers move these curves:
#
# * **overlap** communication with the backward pass (DDP's buckets; almost nothing overlaps here);
# * **a larger batch per rank** (weak scaling, or accumulation): more compute for the same bytes sent;
# * **less to send** (compression, notebook 08) or **faster links**.
#
# Amdahl's law puts a ceiling on strong scaling: if a fraction of the work does not spread, the
# speed-up can never exceed 1 / (that fraction). Some worked numbers:

# %% tags=["nbval-check-output"]
print("4 workers, 120 s -> 40 s: speed-up", theory.speedup(120, 40),
      "| efficiency", theory.parallel_efficiency(120, 40, 4))
print("95% parallel work on 8 workers: at most", round(theory.amdahl_speedup(0.95, 8), 2), "x")
print("1000 batches at 0.25 s each:", theory.training_time_s(1000, 0.25), "seconds")
print("compute 30 ms, all-reduce 10 ms, half of it hidden: efficiency",
      round(theory.expected_scaling_efficiency(0.030, 0.010, overlap_fraction=0.5), 3))
print("weak scaling, 8 workers each as fast as 1, 100 s -> 125 s: efficiency",
      theory.weak_scaling_efficiency(100, 125), "(not a speed-up: 8x the work was done)")

# %% [markdown]
# How to measure scaling on a real cluster: fix the job, time it on 1, 2, 4, ... workers (after a
# warm-up, over enough steps to average out noise, a few repeats), compute speed-up and efficiency,
# and compare with what the compute/communication ratio predicts. A large gap between prediction and
# measurement points to stragglers, data loading, or a network slower than you think.
#
# ## Plan a run
#
# You have **6 devices of 16 GB** and **2 hours**, and want to train a **1B-parameter** model with
# **Adam in mixed precision** (16 bytes per parameter as the ZeRO paper counts them: 16-bit weights
# and gradients, an fp32 master copy, Adam's two moments) on 250,000 samples. What you know about the job
# (`theory.TrainingJob()`): one device computes 8 samples per second; activations take about 0.25 GB
# per sample of a device's batch; the devices are joined by 10 GB/s links; the recipe you start from
# used a learning rate of 3e-4 at a global batch of 256.
#
# Propose:
#
# * the parallelism: `"ddp"`, `"zero1"` (DDP with `ZeroRedundancyOptimizer`), `"zero2"`, or `"zero3"`
#   (`"fsdp"`, PyTorch's form of it);
# * the per-device batch and the gradient-accumulation steps (the global batch follows);
# * the learning rate for that global batch;
# * three metrics to watch, from `theory.plan.METRICS`.
#
# `theory.check_plan` checks each choice against the cost models: the memory per device
# (`memory_breakdown` plus activations, keeping 10% free), the time for 250,000 samples (compute, plus
# the communication the stage needs per step, not overlapped: a pessimistic model), the learning rate
# against the linear rule from the recipe, and whether the metrics watch both the run's health and its
# speed. Change the plan below until it holds:

# %%
print("metrics to choose from:", ", ".join(theory.plan.METRICS))
theory.check_plan(parallelism="ddp", per_device_batch=8, accumulation_steps=1, lr=3e-4,
                  metrics=["loss", "validation_loss", "learning_rate"])

# %% [markdown]
# <details><summary><b>A worked answer</b> (try your own plan first)</summary>
#
# * **Not DDP.** DDP keeps all 16 bytes per parameter on every device: 16 GB for the model states
#   alone, before any activation. It does not fit, whatever the batch.
# * **ZeRO-1** shards only the 12 bytes of optimizer state (master copy and moments) over the 6
#   devices: 2 + 2 + 12/6 = 6 bytes per parameter, 6 GB. In PyTorch it is DDP with
#   `ZeroRedundancyOptimizer`, and it communicates more than DDP: DDP's all-reduce of the gradients,
#   then each rank broadcasts the parameters it updated, an all-gather's worth (notebooks 06 and 15):
#   1.5 all-reduces per step. (The ZeRO paper's ZeRO-1 reduce-scatters the gradients instead, one
#   all-reduce's worth in all.) ZeRO-2 (4.3 GB) and ZeRO-3 (16/6 = 2.7 GB) fit too, but ZeRO-2
#   reduce-scatters on every micro-batch when accumulating (2 all-reduces' worth per step at 3
#   micro-batches), and ZeRO-3 gathers the parameters twice per micro-batch (1.5x DDP's traffic, per
#   micro-batch): with 6 devices there is room enough that ZeRO-1 is the cheaper choice.
# * **Batch:** 16 per device leaves room (6 + 16 x 0.25 = 10 GB of 14.4 usable). Accumulating 3
#   micro-batches gives a global batch of 16 x 6 x 3 = 288, close to the recipe's 256, and 6 s of
#   compute per 0.33 s all-reduce and 0.17 s of broadcasts: 92% efficiency, 1.6 h for the 250,000
#   samples.
# * **Learning rate:** linear rule, 3e-4 x 288 / 256 = 3.375e-4, with a warm-up, then tune.
# * **Metrics:** the loss (health), the throughput in samples per second (speed: will it finish in
#   2 hours?), and the peak memory per device (headroom).
#
# </details>
#
# The worked answer, checked:

# %% tags=["nbval-check-output"]
worked = theory.check_plan(parallelism="zero1", per_device_batch=16, accumulation_steps=3, lr=3.375e-4,
                           metrics=["loss", "throughput", "peak_memory"])
print(worked)
print("\nverdicts:", worked.verdicts())
print("plain DDP, same batch, fits in memory:",
      theory.check_plan("ddp", 16, 3, 3.375e-4, ["loss", "throughput", "peak_memory"]).verdicts()["memory per device"])
print("ZeRO-3 model states per device, GB:", round(theory.memory_per_device_bytes(1e9, devices=6, zero_stage=3) / 1e9, 2))

# %% [markdown]
# ## Build it yourself
#
# The exercise nearest this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on
# ranks the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise ddp-from-hooks`: what keeps the speed-up above near its ideal, built by hand: buckets of
#   gradients whose all-reduces start while backward is still computing the earlier layers, checked
#   against DDP's own gradients, the overlap watched as it happens.
#
# ## Practice

# %%
# %quiz scaling -n 3

# %%
# %quiz why-distribute -n 3

# %%
# %dist stop
