# %% [markdown]
# # 15 · FSDP2 memory: what each rank holds, at rest and at the peak of a step
#
# Notebook 06 counted weights, gradients and Adam states per rank for DDP, ZeRO-1 and FSDP and found
# the ZeRO formulas count tensors exactly. This lab goes further, on the labs' small GPT
# (`distlab.nn`, 0.83 M parameters, fp32, Adam) and PyTorch's current FSDP, **FSDP2**
# (`torch.distributed.fsdp.fully_shard`, whose parameters are `DTensor`s sharded on dim 0):
#
# 1. five ways to train it on 2 ranks: DDP, ZeRO-1 (`ZeroRedundancyOptimizer`), FSDP2 resharding after
#    forward (ZeRO-3), FSDP2 keeping parameters gathered from forward to backward (ZeRO-2 at the peak)
#    and FSDP2 gathering in bf16. Each is watched (`distlab.watch`): its records carry the rank's
#    `memory` and every `collective` of the step, which we put next to `distlab.theory`;
# 2. what CPU offload would change on a GPU;
# 3. activation checkpointing: the peak of a step with and without, and what the recompute costs;
# 4. a 2-D mesh on 4 ranks: tensor parallelism inside pairs of ranks, FSDP2 across them, checked
#    against one process training the same model on the same data.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# ## Five ways to hold the same model
#
# Every rank builds the same GPT (seed 0) and trains it 3 steps on its own batches of Python's
# reference documentation (8 windows of 64 characters). The FSDP2 models shard each block, then the
# whole model (embeddings, final norm, head): 5 units, gathered one at a time.
#
# The watch's `memory` is what the rank holds when the step's update is done (`parameters_bytes`,
# `gradients_bytes`, `optimizer_bytes`: local shards) and `peak_bytes`. On a CPU the peak comes from
# counting the tensors that ops make, plus the storage FSDP2 gathers a unit's weights into: it keeps
# that storage and **resizes** it (to 0 when it reshards, back when it gathers), which no op reports,
# so the watch counts FSDP2's two resizing functions while a step runs. To see *which* weights are
# whole at the peak, we also measure them directly: FSDP2 swaps a unit's registered parameters from
# sharded `DTensor`s to plain gathered tensors while it is gathered, so `gathered()` below adds up the
# plain ones, probed when each block starts its forward, when the loss is ready, and when each block's
# backward starts.
#
# **Predict first**: with Adam in fp32 on 2 ranks, how many bytes per parameter does a rank hold
# under ZeRO-1 (its weights, its gradients and its share of Adam's states)?

# %%
import distlab
from distlab import theory
from distlab.quiz import predict


def bytes_per_parameter(strategy):
    """What theory says a rank holds per parameter, at rest: weights, gradients and Adam's states (fp32, 2 ranks)."""
    held = theory.sharded_memory(1_000_000, strategy, 2, precision="fp32")
    return (held.parameters_bytes + held.gradients_bytes + held.optimizer_bytes) / 1_000_000


zero1_q = predict("With Adam in fp32 on 2 ranks, how many bytes per parameter does each rank hold under ZeRO-1 "
                  "(weights, gradients and its share of Adam's states)?", theory=bytes_per_parameter,
                  tolerance=0.05, strategy="zero1")
zero1_q

# %%
# %%ddp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.nn import GPT, CharTokenizer, GPTConfig, corpus, token_batches

text = corpus()
tok = CharTokenizer(text)
cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=64, layers=4, hidden=128, heads=4)
batches = token_batches(tok.encode(text), batch_size=8, seq_len=64, rank=rank, world_size=world_size, device=device)
KINDS = ("ddp", "zero1", "fsdp2", "fsdp2-keep", "fsdp2-bf16")

def build(kind):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if kind in ("ddp", "zero1"):
        model = DDP(model)
    else:
        keep = kind == "fsdp2-keep"              # reshard_after_forward=False
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if kind == "fsdp2-bf16" else None)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=not keep, mp_policy=mp)
        fully_shard(model, reshard_after_forward=not keep, mp_policy=mp)
    if kind == "zero1":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt

def gathered(model):
    """Bytes of FSDP2 parameters gathered whole right now (plain tensors with storage)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters() if not isinstance(p, DTensor)}
    return sum(storages.values())

def probe_gathered(model, seen):
    def probe(*_):
        seen.append(gathered(model))
    def in_backward_too(module, args, out):
        out.register_hook(probe)                 # runs as this block's backward starts
    return [h for b in model.blocks for h in (b.register_forward_pre_hook(probe),
                                                b.register_forward_hook(in_backward_too))]

# %% [markdown]
# `build(kind)` makes one of the five; `gathered` counts the bytes of FSDP2 parameters held whole at a
# moment, and `probe_gathered` takes that count as each block's forward and backward start. Now each
# of the five trains 3 steps, watched: the last step's record holds the rank's memory and every
# collective, and the probes the most that was gathered at once.

# %%
# %%ddp
def train(kind, steps=3):
    model, opt = build(kind)
    fsdp = kind.startswith("fsdp2")
    watch = distlab.watch(model, stats_every=0, checksum_every=0)
    seen = []
    hooks = probe_gathered(model, seen) if fsdp else []
    for step in range(steps):
        x, y = batches[step]
        seen.clear()                             # keep the last step's probes
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        if fsdp:
            seen.append(gathered(model))         # end of forward: the loss is ready
        loss.backward()
        opt.step()
        distlab.log(loss=loss)
    for h in hooks:
        h.remove()
    watch.close()
    record = watch.records()[-1]
    counts = {}
    for c in record["collectives"]:
        n, b = counts.get(c["op"], (0, 0))
        counts[c["op"]] = (n + 1, b + c["bytes"])
    if record["allreduce"]:                      # DDP's gradient buckets, timed apart from the rest
        counts["all_reduce"] = (len(record["allreduce"]), sum(b["bytes"] for b in record["allreduce"]))
    return {"memory": record["memory"], "collectives": counts,
            "gathered_peak": max(seen) if seen else None, "loss": loss.item()}

results = {kind: train(kind) for kind in KINDS}
sizes = {"parameters": sum(p.numel() for p in GPT(cfg).parameters()),          # only counted: CPU
         "block": sum(p.numel() for p in GPT(cfg).blocks[0].parameters()),    # only counted: CPU
         "tensors": len(list(GPT(cfg).parameters()))}                         # only counted: CPU

# %% [markdown]
# ### At rest: parameters, gradients and optimizer states per rank
#
# Theory is `theory.sharded_memory(P, strategy, data_parallel=2, precision="fp32")`: fp32 weights
# (4 bytes) and gradients (4) and Adam's m and v (8); `fsdp2` is ZeRO-3, everything divided by 2.
# FSDP2 in bf16 (`param_dtype`) still keeps fp32 shards: the shard is the master copy, and only the
# gathered copy is bf16, so its resident bytes are those of fp32 (the "mixed" layout's 2 + 2 + 12
# bytes are the same 16 bytes split another way).

# %% tags=["nbval-check-output"]
lab = distlab.current_lab()
results, sizes = lab.pull("results"), lab.pull("sizes")[0]
P = sizes["parameters"]
STRATEGY = {"ddp": "ddp", "zero1": "zero1", "fsdp2": "fsdp2", "fsdp2-keep": "fsdp2", "fsdp2-bf16": "fsdp2"}
PARTS = (("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"), ("Adam states", "optimizer_bytes"))
print(f"P = {P:,} parameters in {sizes['tensors']} tensors; largest FSDP2 unit (a block): {sizes['block']:,}\n")
print(f"{'':>11} {'':>12} {'rank 0':>10} {'rank 1':>10} {'theory':>10} {'error 0':>8} {'error 1':>8}")
for kind, strategy in STRATEGY.items():
    th = theory.sharded_memory(P, strategy, 2, precision="fp32")
    expected = {"parameters_bytes": th.parameters_bytes, "gradients_bytes": th.gradients_bytes,
                "optimizer_bytes": th.optimizer_bytes}
    for label, key in PARTS:
        got = [results[r][kind]["memory"][key] for r in (0, 1)]
        errors = " ".join(f"{100 * (g / expected[key] - 1):+7.2f}%" for g in got)
        print(f"{kind:>11} {label:>12} {got[0]:>10,} {got[1]:>10,} {expected[key]:>10,.0f} {errors}")

# %%
held = [sum(results[r]["zero1"]["memory"][key] for _, key in PARTS) / P for r in (0, 1)]
print(f"ZeRO-1: rank 0 holds {held[0]:.2f} bytes per parameter, rank 1 {held[1]:.2f}")
zero1_q.reveal(sum(held) / 2)

# %% [markdown]
# Every difference is a tensor the formula does not count, and each can be counted to the byte:
#
# * **Adam's `step`**: Adam keeps a step counter per parameter tensor, a 4-byte fp32 scalar:
#   69 tensors x 4 = 276 bytes above 8 P in DDP (+0.004%), held by whichever rank updates the tensor.
# * **ZeRO-1's split** is not exactly half: `ZeroRedundancyOptimizer` gives whole tensors to ranks,
#   largest first, each to the rank with the fewest so far; the two ranks' Adam bytes add up to DDP's.
# * **FSDP2's padding**: FSDP2 cuts each parameter on dim 0 into 2 equal chunks, padding the last.
#   The vocabulary (the token embedding's and the head's rows) is odd, so each of these two tensors
#   gets one padding row of 128 floats (512 bytes), stored by rank 1: every rank's shard storage is
#   the larger half, 2 x 256 bytes above P x 4 / 2 (+0.03%), for weights and for gradients. Adam's
#   m and v are made the size of the local shard *without* the padding: rank 0 holds one more row
#   of each of the two tensors than rank 1 (2 x 512 bytes more of m and v each).

# %% [markdown]
# ### The peak of a step
#
# What a step adds on top: the activations kept for backward, the gradients as backward makes them,
# and, for FSDP2, the gathered weights. `theory.sharded_memory(...).peak_extra_bytes` counts only the
# last: with `reshard_after_forward=True` the unit computing and the one prefetched,
# 2 x the largest unit (`largest_unit_parameters`); without it, the whole model at the end of the
# forward (gathered units stay until their backward); in bf16, at 2 bytes each.

# %% tags=["nbval-check-output"]
UNIT = {"fsdp2": (True, "fp32"), "fsdp2-keep": (False, "fp32"), "fsdp2-bf16": (True, "mixed")}
print(f"{'':>11} {'gathered, measured':>19} {'theory':>10} {'error':>8}")
for kind, (reshard, precision) in UNIT.items():
    th = theory.sharded_memory(P, "fsdp2", 2, precision=precision, reshard_after_forward=reshard,
                               largest_unit_parameters=sizes["block"])
    got = results[0][kind]["gathered_peak"]
    print(f"{kind:>11} {got:>19,} {th.peak_extra_bytes:>10,.0f} {100 * (got / th.peak_extra_bytes - 1):>+7.1f}%")

# %% [markdown]
# * **Keeping the weights** (`fsdp2-keep`) gathers the whole model by the end of the forward: the
#   measured peak is P x 4 bytes, to the padding (+0.03%). That is why reshard_after_forward=False is
#   ZeRO-2 at the peak: the weights are whole on every rank, as in DDP, at the moment activations are
#   largest too; in exchange the backward needs no second all-gather (below).
# * **Resharding** holds less than the formula's 2 units: the root unit (embeddings, norm, head:
#   34,816 parameters, 139,264 bytes) and one block (793,088 bytes), plus 1,024 bytes of padding. The
#   root's forward wraps the blocks', so it stays gathered while they run. The formula's second unit is
#   the one prefetched: FSDP2 gathers the next block into a flat buffer of its own while this one
#   computes, and copies it into that block's parameters only when its turn comes, so these probes
#   never see it whole; the flat buffer is as large (the tensor count of the watch sees it).
# * **bf16** halves it: the gathered copy is bf16.
#
# The whole step, as the watch counts it: what the rank held at the step's start plus the most bytes
# of tensors alive at once during it, the gathered weights included: `fsdp2-keep` reads higher than
# `fsdp2`, which frees each unit after use. Whatever the configuration, the activations kept for backward (about 18 MB,
# measured below) dominate: sharding model states does nothing for them; bf16 compute halves them.
# Activation checkpointing is the lever for them.

# %%
print(f"{'':>11} {'step peak (MB), rank 0':>23} {'held after the step (MB)':>25}")
for kind in STRATEGY:
    m = results[0][kind]["memory"]
    resident = m["parameters_bytes"] + m["gradients_bytes"] + m["optimizer_bytes"]
    print(f"{kind:>11} {m['peak_bytes'] / 1e6:>23.2f} {resident / 1e6:>25.2f}")

# %% [markdown]
# ### Collectives per step
#
# The watch's `collectives` give each all-gather and reduce-scatter of the step with its size (the
# whole gathered output, the whole reduced input); DDP's all-reduces are its gradient buckets. Each
# rank sends (N-1)/N of an all-gather's or reduce-scatter's size and 2(N-1)/N of an all-reduce's
# (`theory.collective_bytes`). Theory: `ddp_bytes_per_step(4P, 2)` for DDP and ZeRO-1,
# `fsdp_bytes_per_step(4P, 2, reshard_after_forward)` for FSDP2 (for bf16: of 2P bytes).

# %% tags=["nbval-check-output"]
THEORY_SENT = {
    "ddp": theory.ddp_bytes_per_step(4 * P, 2),
    "zero1": theory.ddp_bytes_per_step(4 * P, 2),
    "fsdp2": theory.fsdp_bytes_per_step(4 * P, 2, reshard_after_forward=True),
    "fsdp2-keep": theory.fsdp_bytes_per_step(4 * P, 2, reshard_after_forward=False),
    "fsdp2-bf16": theory.fsdp_bytes_per_step(2 * P, 2, reshard_after_forward=True),
}
print(f"{'':>11} {'all-gathers':>20} {'reduce-scatters':>20} {'all-reduces':>18} {'sent':>10} {'theory':>10} {'error':>7}")
for kind, expected in THEORY_SENT.items():
    ops = results[0][kind]["collectives"]
    cells = [f"{ops[op][0]:>3} x, {ops[op][1]:>10,} B" if op in ops else "-" for op in
             ("all_gather", "reduce_scatter", "all_reduce")]
    sent = sum(theory.collective_bytes(op, b, 2).sent_bytes for op, (n, b) in ops.items())
    print(f"{kind:>11} {cells[0]:>20} {cells[1]:>20} {cells[2]:>18} {sent:>10,.0f} {expected:>10,.0f} "
          f"{100 * (sent / expected - 1):>+6.2f}%")
print("\nthe same on both ranks:", all(
    results[0][k]["collectives"] == results[1][k]["collectives"] for k in STRATEGY))

# %% [markdown]
# * DDP sends 2 (N-1)/N x 4P in two buckets. ZeRO-1 as PyTorch builds it (`ZeroRedundancyOptimizer`
#   under DDP) does the same all-reduce, then each rank broadcasts the shard it updated: about
#   (N-1)/N x 4P more, which the watch does not show on a DDP model (it times DDP's buckets only).
#   The ZeRO paper's ZeRO-1 reduce-scatters the gradients instead of all-reducing them, and so moves
#   DDP's 2 (N-1)/N x 4P in all; `ddp_bytes_per_step` is that figure.
# * FSDP2 gathers each of the 5 units twice (forward and again for backward) and reduce-scatters each
#   unit's gradients once: 3 (N-1)/N x 4P, 1.5x DDP. Keeping the weights from forward to backward
#   skips the second gather: DDP's bytes. The +0.03% is the padding rows again: they travel too.
# * `param_dtype=torch.bfloat16` halves both: the gathers are of bf16 shards, and with no
#   `reduce_dtype` the gradients are reduced in bf16 too (set `reduce_dtype=torch.float32` to reduce
#   in fp32: then only the gathers halve). The loss moves in its third digit:

# %%
for kind in STRATEGY:
    print(f"{kind:>11}: last loss, rank 0 {results[0][kind]['loss']:.4f}")

# %% tags=["nbval-check-output"]
ddp_loss = results[0]["ddp"]["loss"]
for kind in STRATEGY:
    gap = abs(results[0][kind]["loss"] / ddp_loss - 1)
    print(f"{kind:>11}:", "DDP's loss to 1e-4" if gap < 1e-4 else "within 1% of DDP's" if gap < 0.01 else "far from DDP's")

# %% [markdown]
# ## CPU offload: what it would change on a GPU
#
# `fully_shard(..., offload_policy=CPUOffloadPolicy())` keeps the sharded parameters, their gradients
# and (since the optimizer steps on the parameters where they are) the optimizer states in host
# memory; FSDP2 copies each unit's shards to the GPU before its all-gather and the reduced gradient
# shards back after the reduce-scatter, and the optimizer step runs on the CPU (PyTorch's
# `fully_shard` documentation: "offloads sharded parameters, gradients, and optimizer states to CPU;
# the optimizer step runs on CPU"). On a GPU the device would keep only the gathered units, activations
# and communication buffers: `theory.sharded_memory(P, "fsdp2", N, cpu_offload=True)` moves the
# resident bytes to `offloaded_bytes` and keeps `peak_extra_bytes`. The price is host-device copies
# of every shard every step and a CPU optimizer step. Here the device *is* the CPU: offloading would
# copy tensors to where they already are, and nothing would change, so we do not pretend to measure it.

# %% tags=["nbval-check-output"]
off = theory.sharded_memory(P, "fsdp2", 2, precision="fp32", cpu_offload=True, largest_unit_parameters=sizes["block"])
print(f"GPU-resident model states: {off.total_bytes:,.0f} B; in host memory: {off.offloaded_bytes:,.0f} B; "
      f"gathered at the peak: {off.peak_extra_bytes:,.0f} B")

# %% [markdown]
# ## Activation checkpointing
#
# The activations are most of the peak. `model.set_activation_checkpointing(True)` wraps each block in
# `torch.utils.checkpoint`: the forward keeps only the block's input, and the backward runs the
# block's forward again to get the rest. Each rank measures one step of its own plain model (no
# communication) with `distlab.telemetry.track_memory()`: the bytes still held when the forward ends
# (what is kept for backward) and the peak of the whole step; then the median time of 5 steps each way.

# %%
# %%ddp
import time

from distlab.telemetry import track_memory


def one_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    with track_memory() as fwd:
        _, loss = model(x, y)
    loss.backward()
    opt.step()
    return fwd.retained_bytes

checkpointing = {}
for on in (False, True):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    model.set_activation_checkpointing(on)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batches[0]
    one_step(model, opt, x, y)                   # Adam's states exist from here on
    with track_memory() as step_mem:
        kept = one_step(model, opt, x, y)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        one_step(model, opt, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)       # CUDA runs asynchronously: time the step, not its launch
        times.append(time.perf_counter() - t0)
    checkpointing[on] = {"kept": kept, "peak": step_mem.peak_bytes, "step_s": sorted(times)[2]}

# %% [markdown]
# Theory, per layer: `theory.activation_bytes_per_layer(64, 8, 128, 4, recompute=..., bytes_per_element=4)`.
# Its "none" counts what Megatron-LM's layer keeps (Korthikanti et al. 2022): 34 s b h in 16 bits
# (16 activations + 2 one-byte dropout masks) plus the attention scores 5 a s^2 b; "full" keeps the
# layer's input, s b h elements.

# %% tags=["nbval-check-output"]
s, b, h, a, L = 64, 8, 128, 4, 4
none = theory.activation_bytes_per_layer(s, b, h, a, recompute="none", bytes_per_element=4)
full = theory.activation_bytes_per_layer(s, b, h, a, recompute="full", bytes_per_element=4)
print(f"theory per layer: none {none:,.0f} B, full {full:,.0f} B, ratio {none / full:.1f}")

# %%
ac = lab.pull("checkpointing")[0]
kept_off, kept_on = ac[False]["kept"], ac[True]["kept"]
per_layer = (kept_off - kept_on) / L + full     # the blocks' share, plus the input checkpointing keeps
print(f"kept for backward, whole model: {kept_off / 1e6:.2f} MB without, {kept_on / 1e6:.2f} MB with checkpointing")
print(f"per layer, measured: none {per_layer:,.0f} B, full {full:,.0f} B (the input), "
      f"ratio {per_layer / full:.1f}")
print(f"step peak: {ac[False]['peak'] / 1e6:.2f} MB without, {ac[True]['peak'] / 1e6:.2f} MB with "
      f"({100 * (1 - ac[True]['peak'] / ac[False]['peak']):.0f}% less)")
print(f"step time (median of 5): {1e3 * ac[False]['step_s']:.1f} ms without, {1e3 * ac[True]['step_s']:.1f} ms with "
      f"(+{100 * (ac[True]['step_s'] / ac[False]['step_s'] - 1):.0f}%: the blocks' forward, run again)")

# %% [markdown]
# The memory claims, checked (bytes do not move with the machine's load; the time does, so it is only
# shown above):

# %% tags=["nbval-check-output"]
print("checkpointing keeps under a quarter of the bytes for backward:", kept_on < kept_off / 4)
print("and the step's peak falls by more than a third:", ac[True]["peak"] < (2 / 3) * ac[False]["peak"])

# %% [markdown]
# What holds and what does not:
#
# * **The ratio**: checkpointing keeps one tensor per block where the full layer kept a dozen or more.
#   The formula's absolute bytes do not carry over, for reasons we can name: there is no dropout here
#   (dropout=0, so no masks), PyTorch's CPU attention (`scaled_dot_product_attention`) is a fused kernel
#   that keeps the softmax statistics, not the s x s scores (the 5as/h term, 9 a s^2 b bytes in fp32,
#   is not kept), and its own layout of saved tensors differs from Megatron's count (GELU's input, the
#   LayerNorm statistics). Measured per layer sits below the formula's "none" for those reasons.
# * **The peak** falls by less than the kept bytes: at the peak, a recomputed block's activations are
#   alive again (one block at a time), and the logits and their gradient (batch x seq x vocab) and
#   Adam's temporaries are not in any block.
# * **The price**: one more forward of the blocks. If a step were forward + backward only, with
#   backward ~ 2x forward, that is up to a third more; this step also holds the embeddings, the head and
#   the loss (not recomputed) and Adam's update, so the measured share is smaller, and it moves from run
#   to run on a shared 2-core machine.
#
# ## A 2-D mesh: tensor parallel inside pairs, FSDP2 across them
#
# Four ranks as a 2 x 2 mesh: `tp` pairs (ranks 0-1, 2-3) split every block Megatron-style
# (`distlab.nn.tensor_parallel_plan`: q, k, v and fc by columns, out and proj by rows), and `dp` pairs
# (ranks 0-2, 1-3) shard what the tp ranks hold with FSDP2. Each dp group reads its own half of the
# global batch of 8; the loss averaged over dp must be the loss of one process training the whole
# model on the whole batch.

# %%
# %dist restart -n 4

# %%
# %%ddp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from distlab.nn import GPT, CharTokenizer, GPTConfig, corpus, tensor_parallel_plan, token_batches

text = corpus()
tok = CharTokenizer(text)
tokens = tok.encode(text)
cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=64, layers=4, hidden=128, heads=4)
mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
dp_group = mesh["dp"].get_group()

torch.manual_seed(0)
model = GPT(cfg).to(device)
reference = GPT(cfg).to(device)
reference.load_state_dict(model.state_dict())    # the single-process twin, on every rank
plan = tensor_parallel_plan(model)
split = sum(p.numel() for name, p in model.named_parameters()
            if name.rsplit(".", 1)[0] in plan and not (name.endswith("bias") and name.split(".")[-2] in ("out", "proj")))
parallelize_module(model, mesh["tp"], plan)
for block in model.blocks:
    fully_shard(block, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)

mine = token_batches(tokens, batch_size=4, seq_len=64, rank=mesh["dp"].get_local_rank(), world_size=2, device=device)
whole = token_batches(tokens, batch_size=8, seq_len=64, device=device)
watch = distlab.watch(model, stats_every=0, checksum_every=0)
losses, ref_losses = [], []
for step in range(3):
    x, y = mine[step]
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=dp_group)
    losses.append(mean.item() / 2)
    X, Y = whole[step]
    ref_opt.zero_grad(set_to_none=True)
    _, ref_loss = reference(X, Y)
    ref_loss.backward()
    ref_opt.step()
    ref_losses.append(ref_loss.item())
watch.close()
last = watch.records()[-1]
mesh_memory = last["memory"]
mesh_counts = {}
for c in last["collectives"]:
    if c["start_s"] > last["step_time_s"]:                 # after the update: the loss's average, over dp
        key = "after the update: all_reduce over dp"
    else:
        key = f"{c['op']} over {'tp' if c['op'] == 'all_reduce' else 'dp'}"    # TP all-reduces activations; FSDP2 the rest
    n, nbytes = mesh_counts.get(key, (0, 0))
    mesh_counts[key] = (n + 1, nbytes + c["bytes"])
mesh_result = {"memory": mesh_memory, "losses": losses, "reference": ref_losses, "split": split,
               "collectives": mesh_counts}

# %% tags=["nbval-check-output"]
import math

mesh_results = lab.pull("mesh_result")
th = theory.sharded_memory(P, "fsdp2", data_parallel=2, tensor_parallel=2, precision="fp32")
split = mesh_results[0]["split"]
exact = 4 * (split / 4 + (P - split) / 2)        # what the plan splits / 4; embeddings, norms, head, row biases / 2
print(f"parameter bytes per rank: theory P x 4 / 4 = {th.parameters_bytes:,.0f}; "
      f"counting what the plan leaves whole on both tp ranks: {exact:,.0f}")
for r, res in sorted(mesh_results.items()):
    got = res["memory"]["parameters_bytes"]
    print(f"rank {r}: {got:,} B of parameters ({100 * (got / th.parameters_bytes - 1):+.1f}% against P x 4 / 4, "
          f"{100 * (got / exact - 1):+.2f}% against the exact count), {res['memory']['optimizer_bytes']:,} B of Adam states")
print("loss equals the single-process reference (rtol 1e-5):",
      all(math.isclose(a, b, rel_tol=1e-5) for res in mesh_results.values()
          for a, b in zip(res["losses"], res["reference"])))
print("collectives of one step, rank 0:", mesh_results[0]["collectives"])
n_ar, ar_bytes = mesh_results[0]["collectives"]["all_reduce over tp"]
tp_theory = theory.tensor_parallel_bytes_per_step(4, 64, 128, 4, tensor_parallel=2, bytes_per_element=4)
print(f"tensor-parallel bytes sent per rank: {theory.collective_bytes('all_reduce', ar_bytes, 2).sent_bytes:,.0f} "
      f"in {n_ar} all-reduces; theory {tp_theory:,.0f}")

# %% [markdown]
# * `sharded_memory(tensor_parallel=2, data_parallel=2)` divides every parameter by 4. The plan splits
#   only the blocks' linear layers (their weights, and the biases of the column-split ones): the
#   embeddings, the LayerNorms, the head and the biases added after the row-split sums are whole on
#   both tp ranks, so FSDP2 divides them by 2 only. Counting that, the measured bytes match to the
#   padding (the odd vocabulary again).
# * The losses agree with one process training the whole model on the whole batch to float rounding:
#   the two tp ranks add partial sums in another order, nothing else differs.
# * Traffic is of two kinds. Tensor parallelism all-reduces **activations** over `tp`, each
#   b x s x h = 4 x 64 x 128 floats: 2 per block in forward (after out and proj) and 2 in backward,
#   for the gradients of attention's and the MLP's inputs (the plan makes each input one replicated
#   DTensor, so q, k and v share one all-reduce, as Megatron-LM's fused qkv does): 4 per block, as in
#   `theory.tensor_parallel_bytes_per_step`. FSDP2 gathers and reduce-scatters **parameters** over
#   `dp`, as on one dimension. The loop's own all-reduce of the loss, after the update, is in the
#   step's record too (the watch gives what comes after an update to the step it follows; its
#   `start_s` is past the step's time), counted apart.
#
# ## Clipping gradients that are sharded
#
# Gradient clipping scales every gradient by `max_norm / ||g||` when `||g|| > max_norm`, where `||g||`
# is the norm of **all** the model's gradients together (`torch.nn.utils.clip_grad_norm_`). Under FSDP2
# each rank holds a quarter of every gradient, so the norm of what it holds is a part of the whole.
# The squares add up: `||g||^2` is the sum over the ranks of their shards' sums of squares.
#
# **Predict first**: the FSDP2 gradients are DTensors. What does `clip_grad_norm_` on them have to
# send between the ranks?

# %%
clip_guess = predict("clip_grad_norm_ on a model FSDP2 shards over 4 ranks: what does it send between them?",
                     choices={"nothing": "nothing: each rank clips its own shards",
                              "one_number": "one all-reduce of one number a rank (the sums of squares)",
                              "gradients": "an all-gather of the gradients, to take the norm of the whole"},
                     answer="one_number")
clip_guess

# %% [markdown]
# **Then measure**, on the 4 ranks: a small MLP sharded by FSDP2, one backward, then clipped at
# `max_norm = 0.1` two ways, against one process clipping the whole model's gradients:
#
# - **wrong**: each rank clips its own shards by the norm of its own shards;
# - **right**: `clip_grad_norm_` on the DTensor gradients, its collectives counted by `CommDebugMode`.

# %%
# %%ddp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

MAX_NORM = 0.1


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)


def sharded_grads():
    model = mlp()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    nn.functional.mse_loss(model(x_clip), y_clip).backward()
    return model


x_clip = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)).to(device)
y_clip = torch.randn(32, 1, generator=torch.Generator().manual_seed(2)).to(device)
whole = mlp()                                            # one process: the reference
nn.functional.mse_loss(whole(x_clip), y_clip).backward()
whole_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), MAX_NORM).item()

wrong = sharded_grads()                                  # each rank by its own shards' norm
local_norm = torch.sqrt(sum((p.grad.to_local() ** 2).sum() for p in wrong.parameters())).item()
with torch.no_grad():
    for p in wrong.parameters():
        p.grad.to_local().mul_(min(1.0, MAX_NORM / local_norm))

right = sharded_grads()                                  # torch's, on the DTensor gradients
with CommDebugMode() as comm:
    total = torch.nn.utils.clip_grad_norm_(right.parameters(), MAX_NORM)


def apart(model):
    return max((p.grad.full_tensor() - w.grad).abs().max().item() for p, w in zip(model.parameters(), whole.parameters()))


clipping = {"local norm": local_norm, "total norm": total.full_tensor().item(), "whole norm": whole_norm,
            "collectives": {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()},
            "wrong apart": apart(wrong), "right apart": apart(right)}

# %%
clipping = lab.pull("clipping")
for r, c in clipping.items():
    print(f"rank {r}: its shards' norm {c['local norm']:.4f}; clip_grad_norm_'s total {c['total norm']:.4f} "
          f"(one process: {c['whole norm']:.4f}), its collectives {c['collectives']}; clipped gradients apart "
          f"from one process's: own norm {c['wrong apart']:.1e}, clip_grad_norm_ {c['right apart']:.1e}")
combined = sum(c["local norm"] ** 2 for c in clipping.values()) ** 0.5
print(f"the ranks' shard norms combined, sqrt(sum of squares): {combined:.4f}")
clip_guess.reveal("one_number" if all(c["collectives"] == {"all_reduce": 1} for c in clipping.values()) else "other")

# %% tags=["nbval-check-output"]
print("the shards' norms combine into the whole model's norm:", abs(combined - clipping[0]["whole norm"]) < 1e-5)
print("clip_grad_norm_ on DTensors: one all-reduce, the whole model's norm, one process's clipped gradients:",
      all(c["collectives"] == {"all_reduce": 1} and abs(c["total norm"] - c["whole norm"]) < 1e-5
          and c["right apart"] < 1e-6 for c in clipping.values()))
print("clipping each shard by its own norm gives other gradients:", all(c["wrong apart"] > 1e-3 for c in clipping.values()))

# %% [markdown]
# Each rank's own norm was smaller than the whole's, and different on every rank: clipped by it, each
# quarter of the model was scaled by its own factor, so the update points another way than one
# process's. Summing the squares across the ranks first (the single all-reduce `clip_grad_norm_`
# issued on the DTensors) gives every rank the whole norm and the same factor. The same holds for any
# statistic of the whole gradient: a check for NaNs, a gradient-norm log line.
#
# ## Build it yourself
#
# The exercise nearest this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on
# ranks the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise fsdp-shard-sizes`: the shards this lab weighed, counted by hand: how many rows of each
#   parameter a rank's FSDP2 shard holds (the later ranks fewer, or none) and the bytes every rank
#   allocates for its padded shards, checked against `fully_shard`'s own shards on 3 and 4 ranks.
#
# ## Practice
#
# Some of these questions are checked against your ranks: a fresh FSDP2 model is built and stepped
# there when you ask for the answer.

# %%
# %quiz memory-sharding

# %%
# %dist stop
