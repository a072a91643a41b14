# %% [markdown]
# # 07 · Global batch, learning rate, mixed precision and gradient accumulation
#
# Three tools decide how many samples go into one update and what each update costs:
#
# * **more ranks**: each adds its per-device batch to the global batch;
# * **gradient accumulation**: several forward/backward passes add their gradients before one update,
#   reaching a large batch without the memory for it; with DDP, `no_sync()` skips the all-reduce on
#   all but the last of them;
# * **mixed precision**: compute in 16-bit floats where it is safe (autocast), keep the weights and the
#   update in 32 bits.
#
# The bookkeeping first, because it is where real runs go wrong.

# %% [markdown]
# ## The global batch, and the learning rate that goes with it
#
# One optimizer step sees **global batch = per-device batch x devices x accumulation steps**
# samples. For 16 devices with 8 samples each, accumulating 2 steps:

# %% tags=["nbval-check-output"]
from distlab import theory

print("global batch:", theory.global_batch_size(per_device_batch=8, devices=16, accumulation_steps=2))

# %% [markdown]
# If the recipe's learning rate was tuned at a global batch of 256, this run needs no change: it
# *is* 256. If the global batch is multiplied by k, the linear scaling rule says start from LR x k
# (with a warm-up over the first steps, since large early updates are what makes big batches
# unstable), then tune; Adam users often start from the gentler LR x sqrt(k). From a recipe of
# LR 0.1 at 256, going to 1024:

# %% tags=["nbval-check-output"]
print("linear rule:", theory.scaled_learning_rate(0.1, base_batch=256, new_batch=1024))
print("square-root rule:", theory.scaled_learning_rate(0.1, base_batch=256, new_batch=1024, rule="sqrt"))
print("accumulation steps to reach 256 with 8 per device on 16 devices:",
      theory.accumulation_steps_for(256, per_device_batch=8, devices=16))

# %% [markdown]
# ## Accumulation, checked on the ranks
#
# Start two ranks. Each uses micro-batches of 16 samples and accumulates 4 of them per update, so the
# global batch is 16 x 2 x 4 = 128. Three ways of computing the same update:
#
# * **A**: accumulate with `no_sync()` on the first three micro-batches (one all-reduce per update);
# * **B**: accumulate without `no_sync()` (an all-reduce after every backward);
# * **C**: one forward/backward on all 64 samples of the rank at once.
#
# Each micro-batch loss is divided by the number of accumulation steps, so that the accumulated
# gradient is the mean over the 64 samples, as in C.

# %%
# %load_ext distlab
# %dist start -n 2

# %%
# %%ddp
import contextlib
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from sklearn.datasets import load_digits

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32, device=device) / 16.0
Y = torch.tensor(digits.target, device=device)
mine = torch.arange(rank, len(Y), world_size, device=device)   # this rank's samples
MICRO, ACCUM, STEPS = 16, 4, 10

def micro_batch(step, k):
    rows = mine[(step * ACCUM + k) * MICRO:(step * ACCUM + k + 1) * MICRO]
    return X[rows], Y[rows]

def fresh():
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device))
    return model, torch.optim.SGD(model.parameters(), lr=0.2)

def train(how):
    model, opt = fresh()
    with distlab.watch(model) as w:
        for step in range(STEPS):
            if how == "C":
                xs, ys = zip(*(micro_batch(step, k) for k in range(ACCUM)))
                loss = F.cross_entropy(model(torch.cat(xs)), torch.cat(ys))
                loss.backward()
            else:
                for k in range(ACCUM):
                    last = k == ACCUM - 1
                    skip = how == "A" and not last
                    with model.no_sync() if skip else contextlib.nullcontext():
                        x, y = micro_batch(step, k)
                        loss = F.cross_entropy(model(x), y) / ACCUM
                        loss.backward()        # gradients add up in .grad
            opt.step()
            opt.zero_grad(set_to_none=True)
            distlab.log(loss=loss)
    all_reduces = sorted({len(r["allreduce"]) for r in w.records()})
    return [p.detach().cpu().clone() for p in model.module.parameters()], all_reduces   # CPU: for the notebook

results = {how: train(how) for how in "ABC"}
same = {how: all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results[how][0], results["C"][0]))
        for how in "AB"}

# %% tags=["nbval-check-output"]
import distlab
lab = distlab.current_lab()
results, same = lab.pull("results"), lab.pull("same")
for how in "ABC":
    print(f"{how}: all-reduces per update on rank 0 / rank 1:",
          results[0][how][1], "/", results[1][how][1])
print("A (no_sync) gives the weights of C (one big batch):", same[0]["A"] and same[1]["A"])
print("B (sync every micro-batch) gives the weights of C:", same[0]["B"] and same[1]["B"])

# %% [markdown]
# The three agree: accumulation computes the big-batch gradient without ever holding the big
# batch's activations. `no_sync()` changes only the traffic: one all-reduce per update instead of
# four. (With DDP the gradients of the skipped steps stay local; the final backward's all-reduce
# averages the *accumulated* gradients, which is the same thing because averaging is linear.)
#
# `zero_grad(set_to_none=True)` (the default in recent PyTorch) frees the gradient tensors instead
# of filling them with zeros: less memory traffic, and a forgotten backward shows up as `None`
# rather than as a silent zero:

# %%
# %%ddp -r 0
net = torch.nn.Linear(64, 10).to(device)            # a plain model: no collective on one rank
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x, y = micro_batch(0, 0)
F.cross_entropy(net(x), y).backward()
print("gradient after backward:", tuple(net.weight.grad.shape))
opt.zero_grad(set_to_none=True)
print("gradient after zero_grad(set_to_none=True):", net.weight.grad)

# %% [markdown]
# ## Mixed precision with bf16
#
# `torch.autocast` runs selected operations (matrix multiplies, convolutions) in a 16-bit type and
# keeps the rest (reductions, losses, softmax) in fp32. The weights stay fp32, and so do their
# gradients. On GPUs the type is fp16 or bf16; on CPUs it is bf16.
#
# Why fp16 needs a **GradScaler** and bf16 does not: fp16 has 5 exponent bits, so small gradients
# (below about 6e-8) round to zero; the scaler multiplies the loss by a large factor before backward
# and divides the gradients back before the step. bf16 keeps fp32's 8 exponent bits (same range,
# fewer mantissa bits), so small values survive:

# %% tags=["nbval-check-output"]
import torch
g = torch.tensor(1e-8)
print("1e-8 in fp16:", g.half().item(), "| in bf16:", f"{g.bfloat16().item():.2e}")
print("largest fp16:", torch.finfo(torch.float16).max, "| largest bf16:", f"{torch.finfo(torch.bfloat16).max:.2e}")
print("machine epsilon of bf16:", torch.finfo(torch.bfloat16).eps, "vs fp32:", torch.finfo(torch.float32).eps)


# %%
# %%ddp
def train_amp(use_bf16):
    model, opt = fresh()
    dtypes = None
    for step in range(STEPS):
        xs, ys = zip(*(micro_batch(step, k) for k in range(ACCUM)))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            out = model(torch.cat(xs))
            loss = F.cross_entropy(out, torch.cat(ys))
        loss.backward()                    # outside autocast; no scaler needed for bf16
        dtypes = (str(out.dtype), str(loss.dtype), str(model.module[0].weight.grad.dtype))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item(), dtypes

fp32_loss, _ = train_amp(False)
bf16_loss, amp_dtypes = train_amp(True)
if rank == 0:
    print(f"loss after {STEPS} updates: fp32 {fp32_loss:.4f}, bf16 autocast {bf16_loss:.4f}")

# %% tags=["nbval-check-output"]
amp_dtypes = lab.pull("amp_dtypes", ranks=0)[0]
print("under autocast: activations", amp_dtypes[0], "| loss", amp_dtypes[1], "| weight gradients", amp_dtypes[2])
fp32_loss, bf16_loss = lab.pull("fp32_loss", ranks=0)[0], lab.pull("bf16_loss", ranks=0)[0]
print("bf16 loss within 5% of fp32:", abs(bf16_loss - fp32_loss) < 0.05 * fp32_loss)

# %% [markdown]
# ## What mixed precision keeps in memory: two layouts
#
# "Mixed precision" names several ways of storing the model states. Two of them come to
# **16 bytes per parameter with Adam**, and a third, Megatron-LM's for bf16, to 18:
#
# | layout | weights | gradients | fp32 master weights | Adam m + v | total |
# |---|---|---|---|---|---|
# | `torch.autocast` (what you just ran) | 4 (fp32) | 4 (fp32) | none | 4 + 4 | 16 |
# | the ZeRO paper's mixed-precision Adam | 2 (fp16) | 2 (fp16) | 4 | 4 + 4 | 16 |
# | Megatron-LM, bf16 | 2 (bf16) | 4 (fp32) | 4 | 4 + 4 | 18 |
#
# Under autocast the weights and their gradients stay fp32 (the check above printed fp32 weight
# gradients): the 16-bit copies of the weights that the matrix multiplies use are made during the
# forward and freed once the backward has used them, so the stored states are those of fp32
# training. The ZeRO paper (Rajbhandari et al. 2020) counts fp16 weights and gradients and an fp32
# **master** copy of the weights for the optimizer to update: 2 + 2 + 12. Megatron-LM, training in
# bf16, keeps the master copy too but accumulates and all-reduces the gradients in fp32: 2 + 4 + 12
# (its distributed-optimizer guide: 18 bytes per parameter for bf16 weights with fp32 gradients).
# Before counting what the ranks hold, predict:

# %%
from distlab.quiz import predict

guess = predict("Each rank trains with Adam under bf16 autocast. How many bytes per parameter do its weights, "
                "gradients and Adam states take?",
                theory="bytes_per_parameter", unit="B", tolerance=0.05, precision="autocast", optimizer="adam")
guess

# %% [markdown]
# One step with Adam under bf16 autocast on each rank, then the bytes of every tensor the rank holds
# for training: the parameters, their `.grad`, and Adam's state (`exp_avg`, `exp_avg_sq`; its step
# counter, one number per tensor, is left out):

# %%
# %%ddp
def held_bytes(model, opt):
    states = [t for state in opt.state.values() for key, t in state.items() if key != "step"]
    count = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
    return ({"weights": count(model.parameters()),
             "gradients": count(p.grad for p in model.parameters()),
             "optimizer states": count(states)},
            sorted({str(t.dtype) for t in [*model.parameters(), *states]}))

model, _ = fresh()
adam = torch.optim.Adam(model.parameters(), lr=1e-3)
xs, ys = zip(*(micro_batch(0, k) for k in range(ACCUM)))
with torch.autocast(device.type, dtype=torch.bfloat16):
    loss = F.cross_entropy(model(torch.cat(xs)), torch.cat(ys))
loss.backward()
adam.step()                                       # Adam creates m and v on its first step
amp_memory, amp_dtypes_held = held_bytes(model.module, adam)
amp_parameters = sum(p.numel() for p in model.parameters())

# %% tags=["nbval-check-output"]
amp_memory = lab.pull("amp_memory")
P = lab.pull("amp_parameters", ranks=0)[0]
b = theory.memory_breakdown(P, precision="autocast", optimizer="adam")
expected = {"weights": b.weights_bytes, "gradients": b.gradients_bytes, "optimizer states": b.optimizer_states_bytes}
print(f"parameters: {P:,}; dtypes of the stored tensors: {lab.pull('amp_dtypes_held', ranks=0)[0]}")
print(f"{'':>17} {'rank 0':>8} {'rank 1':>8} {'theory':>8}   (bytes)")
for part, value in expected.items():
    print(f"{part:>17} {amp_memory[0][part]:>8,} {amp_memory[1][part]:>8,} {value:>8,.0f}")
measured_per_parameter = sum(amp_memory[0].values()) / P
print("bytes per parameter, measured:", measured_per_parameter,
      "| theory, autocast layout:", theory.bytes_per_parameter("autocast", "adam"))
print("measured equals theory on both ranks:", all(amp_memory[r][k] == v for r in (0, 1) for k, v in expected.items()))

# %%
guess.reveal(measured_per_parameter)

# %% [markdown]
# The count matches to the byte: 4 + 4 + 8 = 16 bytes per parameter, all of it fp32. (Activations come
# on top in both layouts, mostly bf16 under autocast; and DDP keeps its gradient buckets, notebook 06.)
#
# PyTorch's own optimizers do not keep the ZeRO paper's layout (DeepSpeed's ZeRO does, in fp16), so
# take its numbers from `distlab.theory`. Same total as autocast, but split differently, and the split
# matters once the states are sharded (notebook 06): ZeRO-1 shards only the optimizer states, so what
# stays whole on every device is 4 bytes per parameter in the ZeRO paper's layout against 8 under
# autocast. Its fp16 gradients also halve the bytes DDP all-reduces; Megatron-LM's fp32 gradients for
# bf16 do not: they trade those bytes for sums accumulated and reduced in fp32.

# %% tags=["nbval-check-output"]
for layout, name in (("autocast", "autocast"), ("mixed", "ZeRO paper")):
    b = theory.state_bytes_per_parameter(layout, "adam")
    one = theory.memory_breakdown(1, devices=8, zero_stage=1, precision=layout, optimizer="adam")
    print(f"{name:>16}: weights {b.weights} + gradients {b.gradients} + optimizer states {b.optimizer_states} "
          f"= {b.total} bytes; with ZeRO-1 over 8 devices {one.total_bytes:g} bytes per parameter per device")

# %% [markdown]
# The dashboard of the last watched run (C, one big batch per rank):

# %%
lab.dashboard()

# %% [markdown]
# ## Practice

# %%
# %quiz batch-and-lr -n 3

# %%
# %quiz mixed-precision -n 3

# %%
# %dist stop
