# %% [markdown]
# # 14b · DeviceMesh, DTensor and tensor parallelism
#
# Notebook [14](14-collectives.ipynb) took the five collectives apart on 4 emulated nodes: what each
# does, all-reduce rebuilt as a reduce-scatter then an all-gather, and the bytes each rank sends on a
# ring, counted on the links against `theory.collective_bytes`. This lab builds on them. PyTorch wraps
# them in **DTensor**, a tensor that knows how it is laid out over the ranks, and in **tensor
# parallelism** (`parallelize_module`), which lays a model's weights out that way. Here the wrapping
# comes off, one layer at a time:
#
# 1. `DeviceMesh` and `DTensor` on 2 ranks: sharded, replicated and partial tensors, and the collective
#    each change of layout (`redistribute`) issues;
# 2. tensor parallelism: an MLP split as Megatron-LM splits it, then the blocks of a small GPT,
#    gradients checked against one process, collectives counted against Megatron-LM's two per layer;
# 3. sequence parallelism: the same gradients, all-gathers and reduce-scatters in place of all-reduces,
#    and the activation memory it saves, measured against the formula.
#
# Nothing here is counted on a link: the bytes come from the sizes of the tensors each collective
# carries, and the ring formula that notebook 14 checked on the links turns them into bytes per rank.
# 2 ranks on this machine (loopback) are enough.

# %%
# %load_ext distlab
import distlab
from distlab import theory

# %%
# %dist start -n 2

# %% [markdown]
# ## 1. DeviceMesh and DTensor
#
# A **DeviceMesh** names the ranks a tensor is laid out over (`init_device_mesh(device.type, (2,))`: a
# 1-D mesh of 2 ranks; a 2-D mesh such as `(2, 4)` is how tensor and data parallelism are combined,
# notebook 15). A **DTensor** is a global tensor plus a **placement** per mesh dimension:
#
# * `Shard(d)`: cut along dimension d, each rank holds its slice;
# * `Replicate()`: every rank holds all of it;
# * `Partial()`: every rank holds a tensor of the full shape, and the real value is their **sum**: a
#   reduction not done yet.

# %%
# %%ddp
torch.set_num_threads(1)                     # one core per rank
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

mesh = init_device_mesh(device.type, (world_size,))
full = torch.arange(24.0, device=device).reshape(4, 6)     # the same on every rank
rows = distribute_tensor(full, mesh, [Shard(0)])            # rank r keeps rows 2r and 2r + 1
copies = distribute_tensor(full, mesh, [Replicate()])
column_sums = rows.sum(dim=0)               # each rank sums its own rows: a Partial, nothing sent yet
by_hand = DTensor.from_local(rows.to_local().sum(dim=0), mesh, [Partial()])    # the same, built by hand
layouts = {name: (str(t.placements), tuple(t.shape), t.to_local().tolist())
           for name, t in (("rows", rows), ("copies", copies), ("column_sums", column_sums), ("by_hand", by_hand))}
column_sums_full, by_hand_full = column_sums.full_tensor(), by_hand.full_tensor()     # each all-reduces
sums_ok = torch.equal(column_sums_full, full.sum(dim=0)) and torch.equal(by_hand_full, full.sum(dim=0))

# %% tags=["nbval-check-output"]
lab = distlab.current_lab()
layouts = lab.pull("layouts")
for name in layouts[0]:
    placement, shape = layouts[0][name][:2]
    print(f"{name}: placements {placement}, global shape {shape}")
    for r in layouts:
        print(f"    rank {r} holds {layouts[r][name][2]}")
print("full_tensor() of both partials is the column sums of the whole tensor:", all(lab.pull("sums_ok").values()))

# %% [markdown]
# `rows.sum(dim=0)` did no communication: DTensor knows each rank's sum covers its own rows only, so it
# marks the result `Partial(sum)` and leaves the reduction for later, when some op needs the real
# values. `full_tensor()` is one such moment: it all-reduces.
#
# ## 1.1 What each redistribute moves
#
# `t.redistribute(mesh, [placement])` changes a DTensor's layout, with whatever collective that takes.
# `CommDebugMode` (`torch.distributed.tensor.debug`) counts the collectives issued inside it.
#
# **Predict first**: `column_sums` is `Partial`. Asked for `Shard(0)`, each rank must end with its
# slice of the sum. Which collective does that take?

# %%
from distlab.quiz import predict

guess = predict("Partial -> Shard(0) on 2 ranks: which collective does redistribute issue?",
                choices={"all_reduce": "an all-reduce", "reduce_scatter": "a reduce-scatter",
                         "all_gather": "an all-gather", "none": "none: each rank keeps what it has"},
                answer="reduce_scatter")
guess

# %%
# %%ddp
COLLECTIVE = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
              "all_reduce": "all_reduce", "all_to_all_single": "all_to_all",
              "shard_dim_alltoall": "all_to_all"}  # DTensor's own all-to-all op, on CUDA


def collectives(comm):
    """{collective: how many} that a CommDebugMode counted."""
    return {COLLECTIVE.get(str(op).split(".")[-1], str(op)): n for op, n in comm.get_comm_counts().items()}


moves = {}
for move, t, to in (("Shard(0) -> Replicate", rows, Replicate()), ("Replicate -> Shard(0)", copies, Shard(0)),
                    ("Partial -> Replicate", column_sums, Replicate()), ("Partial -> Shard(0)", column_sums, Shard(0)),
                    ("Shard(0) -> Shard(1)", rows, Shard(1))):
    with CommDebugMode() as comm:
        after = t.redistribute(mesh, [to])
    moves[move] = (collectives(comm), tuple(after.to_local().shape))
try:
    copies.redistribute(mesh, [Partial()])
except RuntimeError as e:
    refused = str(e)

# %%
moves = lab.pull("moves", 0)[0]
fraction = {op: theory.collective_bytes(op, 1.0, 2).sent_bytes
            for op in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")}
print(f"{'redistribute':>28} {'collectives issued':>22} {'local shape after':>18} "
      f"{'each rank sends (S: the tensor)':>32}")
for move, (issued, shape) in moves.items():
    cost = " + ".join(f"{fraction[op]:g} S" for op in issued) or "nothing"
    print(f"{move:>28} {issued or 'none'!s:>22} {shape!s:>18} {cost:>32}")
print("\nReplicate -> Partial:", lab.pull("refused", 0)[0])

# %% tags=["nbval-check-output"]
on_gpu = lab.status()[0].device.startswith("cuda")
print("Shard -> Replicate an all-gather, Partial -> Replicate an all-reduce, Partial -> Shard a reduce-scatter, "
      "Replicate -> Shard nothing:",
      [moves[m][0] for m in ("Shard(0) -> Replicate", "Partial -> Replicate", "Partial -> Shard(0)", "Replicate -> Shard(0)")]
      == [{"all_gather": 1}, {"all_reduce": 1}, {"reduce_scatter": 1}, {}])
print("Shard(0) -> Shard(1): an all-to-all on GPUs, an all-gather on CPUs:",
      moves["Shard(0) -> Shard(1)"][0] == ({"all_to_all": 1} if on_gpu else {"all_gather": 1}))

# %% [markdown]
# Your prediction against what the ranks issued for Partial → Shard(0):

# %%
guess.reveal(next(iter(moves["Partial -> Shard(0)"][0]), "none"))

# %% [markdown]
# Each change of layout is one collective, and the names are notebook 14's:
#
# * **Shard → Replicate** is an all-gather; **Replicate → Shard** sends nothing (each rank keeps its
#   slice of what it already has);
# * **Partial → Replicate** is an all-reduce; **Partial → Shard** a reduce-scatter (half the bytes on a
#   ring: only the rank that keeps a slice needs its sum);
# * **Shard(0) → Shard(1)** is an all-to-all on GPUs. On a CPU process group DTensor falls back to an
#   all-gather and keeps its slice (the rank output above shows torch's warning), sending N times what
#   an all-to-all would (each rank needs only a 1/N of each other rank's shard: 0.25 S here).
#
# Redistributing *to* `Partial` is refused: a sum that is not done yet is the result of a computation
# (like `rows.sum(dim=0)`), not a layout to ask for.
#
# ## 2. Tensor parallelism
#
# Tensor parallelism (Shoeybi et al., 2019, "Megatron-LM") splits each layer's weight matrices over the
# ranks. An MLP `x → fc → GELU → proj` is split so that it needs one sum:
#
# * `fc` **column-wise** (`ColwiseParallel`: each rank holds half of its output features): rank r
#   computes its half of the hidden layer from the whole input, and GELU works on its half alone;
# * `proj` **row-wise** (`RowwiseParallel`: each rank holds the rows that take its half of the hidden
#   features): each rank's product is a partial sum of the output, and **one all-reduce** adds them.
#
# In backward it is the mirror image: the gradient of the output is whole on both ranks, and the
# gradient of the input `x` comes out as two partial sums (one per half of `fc`), so **one all-reduce**
# again. Below, the same MLP once split over the 2 ranks and once whole on each rank, the same batch
# for both:

# %%
# %%ddp
import copy

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
whole_mlp = copy.deepcopy(mlp)              # the reference: the whole MLP, on this one process
parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

# the same on both ranks; made by a CPU generator, then moved (a leaf again, for x.grad)
x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
with CommDebugMode() as forward:
    y = mlp(x)
with CommDebugMode() as backward:
    y.pow(2).mean().backward()
x_whole = x.detach().clone().requires_grad_()
y_whole = whole_mlp(x_whole)
y_whole.pow(2).mean().backward()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


mlp_report = {
    "local weights": {name: tuple(p.to_local().shape) for name, p in mlp.named_parameters() if name.endswith("weight")},
    "collectives": (collectives(forward), collectives(backward)),
    "output": torch.allclose(y, y_whole, rtol=1e-5, atol=1e-6),
    "input gradient": torch.allclose(x.grad, x_whole.grad, rtol=1e-5, atol=1e-6),
    "weight gradients": all(torch.allclose(full(p.grad), q.grad, rtol=1e-5, atol=1e-6)
                            for p, q in zip(mlp.parameters(), whole_mlp.parameters())),
}

# %% tags=["nbval-check-output"]
mlp_report = lab.pull("mlp_report", 0)[0]
print("local weight shapes on each rank (whole: fc 256 x 64, proj 64 x 256):", mlp_report["local weights"])
print("collectives, forward:", mlp_report["collectives"][0], " backward:", mlp_report["collectives"][1])
for what in ("output", "input gradient", "weight gradients"):
    print(f"{what} equal to the whole MLP's (rtol 1e-5, atol 1e-6):", mlp_report[what])

# %% [markdown]
# ## 2.1 The blocks of a GPT
#
# The labs' GPT (`distlab.nn.GPT`: 4 pre-norm blocks of width 128 with 4 heads, a ~100-character
# vocabulary) is split the same way by `distlab.nn.tensor_parallel_plan(model)`, the plan
# `parallelize_module` takes. In each block, attention's `q`, `k`, `v` are column-wise (each rank
# computes 2 of the 4 heads: heads need nothing from each other) and `out` row-wise; the MLP's `fc`
# column-wise and `proj` row-wise. Embeddings, norms and the head stay whole on both ranks. The plan
# also makes attention's and the MLP's input a replicated DTensor once (`PrepareModuleInput`): below,
# why.

# %%
# %%ddp
from distlab.nn import GPT, CharTokenizer, GPTConfig, corpus, tensor_parallel_plan, token_batches

text = corpus()
tok = CharTokenizer(text)
cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=64, layers=4, hidden=128, heads=4)
idx, targets = token_batches(tok.encode(text[:100_000]), batch_size=8, seq_len=64,
                             device=device)[0]   # the same on both ranks
plan = tensor_parallel_plan(GPT(cfg))        # only its module names are read: on the CPU
block_plan = {name: type(style).__name__ for name, style in plan.items() if name.startswith("blocks.0.")}

# %% tags=["nbval-check-output"]
for name, style in lab.pull("block_plan", 0)[0].items():
    print(f"{name:>18}: {style}")

# %% [markdown]
# Megatron-LM's count is **two all-reduces per layer in forward** (after attention's `out`, after the
# MLP's `proj`) **and two in backward** (the input gradients of attention and of the MLP), each of the
# b · s · h activation. Count them: one forward and one backward of the batch (8 sequences of 64
# characters), with the collectives of each pass counted apart. Two plans:
#
# * **per projection**: the `ColwiseParallel` and `RowwiseParallel` entries alone. Each of `q`, `k` and
#   `v` then takes the block's input as a plain tensor and turns it into a DTensor of its own, so in
#   backward each of the three all-reduces its own gradient of that input;
# * **input prepared once**: `tensor_parallel_plan`'s own, with `PrepareModuleInput` on `attn` and on
#   `mlp`, which make their input a replicated DTensor once. `q`, `k` and `v` then share it: their three gradients add
#   up locally as one `Partial`, and one all-reduce finishes the sum. That is what Megatron-LM gets by
#   fusing `q`, `k` and `v` into one matrix.

# %%
# %%ddp
import warnings

# CommDebugMode follows every module's backward with a hook, and torch warns that the GPT's first
# modules have no input that requires a gradient (token ids): true, and harmless here.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


PLANS = {
    "per projection": lambda m: {k: v for k, v in tensor_parallel_plan(m).items()
                                 if isinstance(v, (ColwiseParallel, RowwiseParallel))},
    "input prepared once": lambda m: tensor_parallel_plan(m),
    "sequence parallel": lambda m: tensor_parallel_plan(m, sequence_parallel=True),
}


def split_and_reference(kind):
    """The GPT split by plan `kind`, and the same GPT whole (seed 0 for both)."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, PLANS[kind](model))
    return model, reference


def one_step(kind):
    """Collectives of a forward, a backward and an SGD update, counted apart; gradients against the
    whole model's."""
    model, reference = split_and_reference(kind)
    with CommDebugMode() as forward:
        _, loss = model(idx, targets)
    with CommDebugMode() as backward:
        loss.backward()
    _, reference_loss = reference(idx, targets)
    reference_loss.backward()
    pairs = [(full(p.grad), q.grad) for p, q in zip(model.parameters(), reference.parameters())]
    with CommDebugMode() as update:
        # foreach=False: on CUDA, SGD's default multi-tensor update refuses a list that mixes DTensor
        # parameters with plain ones (those the plan leaves whole), measured on an H200.
        torch.optim.SGD(model.parameters(), lr=0.1, foreach=False).step()
    return {"forward": collectives(forward), "backward": collectives(backward), "update": collectives(update),
            "loss difference": abs(loss.item() - reference_loss.item()),
            "largest gradient difference": max((g - h).abs().max().item() for g, h in pairs),
            "gradients allclose": all(torch.allclose(g, h, rtol=1e-4, atol=1e-6) for g, h in pairs),
            "parameters": len(pairs)}


steps = {kind: one_step(kind) for kind in ("per projection", "input prepared once")}

# %% tags=["nbval-check-output"]
steps = lab.pull("steps", 0)[0]
L = 4
print(f"{'':>20} {'forward':>20} {'backward':>20} {'update':>8} {'per layer: forward + backward':>30}")
for kind, s in steps.items():
    per_layer = f"{s['forward'].get('all_reduce', 0) / L:g} + {s['backward'].get('all_reduce', 0) / L:g} all-reduces"
    print(f"{kind:>20} {s['forward']!s:>20} {s['backward']!s:>20} {s['update']!s:>8} {per_layer:>30}")
print(f"{'Megatron-LM':>20} {'':>20} {'':>20} {'':>8} {'2 + 2 all-reduces':>30}")
for kind, s in steps.items():
    print(f"{kind}: all {s['parameters']} gradients equal to one process's (rtol 1e-4, atol 1e-6):",
          s["gradients allclose"])

# %%
for kind, s in steps.items():
    print(f"{kind}: loss differs from one process's by {s['loss difference']:.1e}, "
          f"gradients by at most {s['largest gradient difference']:.1e}")

# %% [markdown]
# Both splits compute the model's gradients, to float rounding: the largest difference is a few times
# 1e-8, where the largest gradients are a few tenths, so the tolerance (`atol` 1e-6) is more than 10
# times what was measured. The absolute tolerance matters: the gradient of `k`'s bias is zero in
# exact arithmetic (adding the same number to every key's score for a query leaves softmax unchanged),
# so both sides hold rounding noise of order 1e-11 there, and a relative comparison of two noises fails.
#
# The forward matches Megatron-LM's count. The backward does too once attention's input is prepared
# once; per projection, it all-reduces four times per layer (`q`, `k`, `v` and `fc`), twice Megatron's
# count, for the same result.
#
# **Bytes.** `distlab.watch` times every collective of a training step and records its size; one SGD
# step of the prepared split, next to `theory.tensor_parallel_bytes_per_step` (each all-reduce of the
# b · s · h activation, fp32 here: 8 x 64 x 128 x 4 bytes = 256 KiB, and each rank sends 2(t-1)/t of it):

# %%
# %%ddp
def watched_step(kind):
    """One SGD step of the split model, watched: {collective: (how many, bytes)}."""
    model, _ = split_and_reference(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)   # as in one_step
    watch = distlab.watch(model, stats_every=0, checksum_every=0)
    _, loss = model(idx, targets)
    loss.backward()
    opt.step()
    watch.close()
    counts = {}
    for c in watch.records()[-1]["collectives"]:
        n, b = counts.get(c["op"], (0, []))
        counts[c["op"]] = (n + 1, b + [c["bytes"]])
    return counts


watched = {kind: watched_step(kind) for kind in ("input prepared once", "sequence parallel")}

# %%
watched = lab.pull("watched", 0)[0]
B, SEQ, H, T = 8, 64, 128, 2
activation = B * SEQ * H * 4


def sent_per_rank(counts):
    """Bytes one rank sends for the collectives a watch recorded (ring model, 2 ranks)."""
    return sum(theory.collective_bytes(op, size, T).sent_bytes for op, (_, sizes) in counts.items() for size in sizes)


tp_theory = theory.tensor_parallel_bytes_per_step(B, SEQ, H, L, T, bytes_per_element=4)
tp = watched["input prepared once"]
print("one step, input prepared once:",
      {op: f"{n} x {set(sizes)} bytes" for op, (n, sizes) in tp.items()})
print(f"each rank sends {sent_per_rank(tp) / 1e6:.3f} MB; "
      f"theory.tensor_parallel_bytes_per_step: {tp_theory / 1e6:.3f} MB")

# %% tags=["nbval-check-output"]
print("every all-reduce carries one b x s x h activation:", all(b == activation for b in tp["all_reduce"][1]))
print("bytes sent per step equal the theory:", sent_per_rank(tp) == tp_theory)

# %% [markdown]
# Every all-reduce carries exactly the 256 KiB activation, 16 of them in a step (4 layers x 2 passes x
# 2), and the bytes are the theory's to the byte: these are sizes of tensors, so the ring formula
# (which notebook 14 measured on the links) turns them into bytes exactly. Tensor parallelism sends
# activations, and sends them in every layer of every micro-batch, twice each way: that is why it is
# kept inside a node, on the fastest links (NVLink), while data parallelism, which sends gradients once
# per step, goes across nodes.
#
# ## 3. Sequence parallelism
#
# With tensor parallelism, the LayerNorms, the residual additions and the dropouts between attention
# and the MLP still run on the whole activation on every rank: the same b · s · h numbers computed
# and **stored twice**. Sequence parallelism (Korthikanti et al., 2022, "Reducing Activation
# Recomputation in Large Transformer Models") splits those along the sequence: each rank keeps s/t
# positions. The all-reduce after attention and after the MLP becomes a **reduce-scatter** (each rank
# keeps the sum for its positions only), and attention and the MLP get their whole input back by an
# **all-gather**: a ring all-reduce *is* a reduce-scatter and an all-gather (notebook 14), so the bytes
# stay the same. `tensor_parallel_plan(model, sequence_parallel=True)` adds `SequenceParallel` on the
# norms and `PrepareModuleInput` that gathers the sequence before attention and the MLP.

# %%
# %%ddp
steps["sequence parallel"] = one_step("sequence parallel")

# %% tags=["nbval-check-output"]
sp = lab.pull("steps", 0)[0]["sequence parallel"]
print("forward:", sp["forward"], " backward:", sp["backward"], " update:", sp["update"])
print(f"all {sp['parameters']} gradients equal to one process's (rtol 1e-4, atol 1e-6):", sp["gradients allclose"])

# %% [markdown]
# Per layer, 2 all-gathers and 2 reduce-scatters in each pass, where tensor parallelism alone had
# 2 all-reduces, plus one all-gather more each way at the ends of the model: this plan keeps the
# embeddings and the head whole (the vocabulary is ~100 characters), so the final norm's output is
# gathered for the head in forward, and the gradient of the embeddings' output in backward (Megatron-LM
# splits the embedding and the head by vocabulary instead).
#
# And the **update** now all-reduces: 18 small tensors. The 9 LayerNorms (2 per block and the final
# one) each have a weight and a bias, replicated on both ranks, but each rank saw only its half of the
# sequence, so after backward their gradients are `Partial` DTensors: each rank holds the sum over its
# own positions. DTensor adds the two when the gradient is used, in `optimizer.step()`: an all-reduce
# of 128 numbers per tensor (Megatron-LM all-reduces them at the end of backward). Small, but a reminder
# that a `Partial` is a sum waiting to be done.
#
# The bytes of the forward and backward, from the watch (it sees the update's all-reduces too, inside
# DTensor's handling of the optimizer's ops; they are set apart here):

# %%
sp_step = dict(watched["sequence parallel"])
update = sp_step.pop("all_reduce", (0, []))   # the norms' Partial gradients, summed in optimizer.step()
print(f"the update: {update[0]} all-reduces of {sorted(set(update[1]))} bytes")
sp_theory = theory.tensor_parallel_bytes_per_step(B, SEQ, H, L, T, bytes_per_element=4, sequence_parallel=True)
print("one step, sequence parallel:", {op: f"{n} x {set(sizes)} bytes" for op, (n, sizes) in sp_step.items()})
print(f"each rank sends {sent_per_rank(sp_step) / 1e6:.3f} MB; theory {sp_theory / 1e6:.3f} MB "
      f"(tensor parallel alone: {tp_theory / 1e6:.3f} MB)")

# %% tags=["nbval-check-output"]
ends = 2 * theory.collective_bytes("all_gather", activation, T).sent_bytes
print("sequence parallel sends what tensor parallelism does, plus the two gathers at the ends:",
      sent_per_rank(sp_step) == sp_theory + ends, "; theory says the same bytes:", sp_theory == tp_theory)

# %% [markdown]
# ### The activation memory it saves
#
# What does splitting the norms save? Activation memory per layer, from Korthikanti et al. (Table 2;
# `theory.activation_bytes_per_layer`), s sequence, b batch, h width, a heads, t ranks, 16-bit
# activations:
#
# * tensor parallel: `sbh (10 + 24/t + 5as/(ht))`: the 10 are kept whole on every rank (the LayerNorm
#   inputs, the inputs of attention and the MLP, two dropout masks);
# * tensor + sequence parallel: `sbh (34 + 5as/h) / t`: nothing whole.
#
# Measured here with `distlab.telemetry.track_memory()` on each rank, around the forward of the 4
# blocks (the embeddings before it, outside): `peak_bytes` is the most bytes of tensors made inside
# that were alive at once, `retained_bytes` what is still alive at the end: the activations the
# blocks keep for backward (and their output). The same batch, three ways: one process, tensor
# parallel, tensor + sequence parallel.

# %%
# %%ddp
from distlab.telemetry import track_memory


def blocks_memory(kind):
    """(peak, retained) bytes of one forward of the blocks, on this rank."""
    if kind == "one process":
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
    else:
        model, _ = split_and_reference(kind)
    h = model.tok(idx) + model.pos(torch.arange(idx.shape[1], device=device))
    with track_memory() as mem:
        for block in model.blocks:
            h = block(h)
    return mem.peak_bytes, mem.retained_bytes


memory = {kind: blocks_memory(kind) for kind in ("one process", "input prepared once", "sequence parallel")}

# %%
memory = lab.pull("memory", 0)[0]
a, sbh = 4, SEQ * B * H
KINDS = {"one process": ("one process", 1, False), "tensor parallel": ("input prepared once", 2, False),
         "tensor + sequence": ("sequence parallel", 2, True)}
paper = {name: theory.activation_bytes_per_layer(SEQ, B, H, a, tensor_parallel=t, sequence_parallel=s,
                                                 bytes_per_element=4)
         for name, (_, t, s) in KINDS.items()}
print(f"{'per layer, rank 0':>18} {'peak (MB)':>10} {'kept (MB)':>10} {'theory (MB)':>12} "
      f"{'kept, fp32 numbers / sbh':>25}")
for name, (kind, t, s) in KINDS.items():
    peak, kept = memory[kind]
    print(f"{name:>18} {peak / L / 1e6:>10.3f} {kept / L / 1e6:>10.3f} {paper[name] / 1e6:>12.3f} "
          f"{kept / L / (4 * sbh):>25.2f}")
tp_kept, sp_kept = memory["input prepared once"][1], memory["sequence parallel"][1]
print(f"\ntensor + sequence / tensor parallel: kept {sp_kept / tp_kept:.3f}, "
      f"peak {memory['sequence parallel'][0] / memory['input prepared once'][0]:.3f}, "
      f"theory {paper['tensor + sequence'] / paper['tensor parallel']:.3f}")

# %% [markdown]
# Sequence parallelism keeps less, but the saving measured (about 9%) is smaller than the formula's
# (18%), and all three measurements sit below the formula. The formula assumes things this model
# does not do, and one thing DTensor does differently. Counted per layer in units of s · b · h fp32
# numbers (4 bytes each; the last column):
#
# * **no attention scores are kept.** The formula's `5as/h` term is the s x s score and softmax
#   matrices of every head (and their dropout mask). `scaled_dot_product_attention` here runs a fused
#   kernel that keeps only a row statistic per query and recomputes the rest in backward, as
#   FlashAttention does on GPUs; that is the term `recompute="selective"` removes;
# * **no dropout masks**: this model's dropout is 0 (the formula's masks are 1 byte per element);
# * what is left is 16 stored activations per position and feature with no parallelism, `4 + 12/t` = 10
#   with tensor parallelism, and `16/t` = 8 with sequence parallelism. The first two are what was
#   measured (16.06 and 10.05: the small rest is LayerNorm's mean and inverse deviation and attention's
#   row statistics, b · s numbers each);
# * **DTensor keeps the gathered inputs.** With sequence parallelism, attention and the MLP compute on
#   the all-gathered input, and autograd keeps that input for the weight gradients of `q`, `k`, `v` and
#   `fc`: 2 whole activations instead of 2 halves, one more sbh per layer at t = 2 (9.16 measured
#   against 8; the extra 0.16 is the statistics again, and the first block's own copy of its slice of
#   the input). Megatron-LM keeps only each rank's slice and all-gathers it again in backward,
#   trading that memory for one more all-gather.
#
# The peak adds what is alive only for a moment, the collectives' buffers and the sums in flight:
# sequence parallelism has more of those (reduce-scatter and all-gather along the sequence make
# copies), so its peak saves less than what it keeps. With more layers the kept part grows and the
# moment's part does not.

# %% tags=["nbval-check-output"]
e, t = 4, 2
model_formula = {"one process": 16 * e, "tensor parallel": (4 + 12 / t) * e,
                 "tensor + sequence": (16 / t + 2 * (1 - 1 / t)) * e}   # bytes per s·b·h, as this model runs
for name, (kind, _, _) in KINDS.items():
    print(f"{name}: kept per layer within 0% to 3% above the formula without scores and masks "
          "(with DTensor's gathered inputs):",
          0 <= memory[kind][1] / L / (model_formula[name] * sbh) - 1 < 0.03)
print("sequence parallel keeps 0.85x to 0.95x of tensor parallel's (theory:",
      f"{paper['tensor + sequence'] / paper['tensor parallel']:.2f}):", 0.85 < sp_kept / tp_kept < 0.95)

# %% [markdown]
# ## Practice
#
# The live questions run on your 2 ranks.

# %%
# %quiz model-parallelism -n 3

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise tensor-parallel-mlp`: a column- then row-split MLP by hand, one all-reduce in forward and one in backward, against the whole MLP.

# %%
# %dist stop
