# %% [markdown]
# # 14c · The vocabulary across ranks: a parallel embedding and loss-parallel cross-entropy
#
# A language model's two largest matrices are often at its ends: the embedding (one row per token of
# the vocabulary) and the output layer (one column per token). Llama 3 8B's vocabulary has 128,256
# tokens (its released configuration) at a width of 4,096: 525 million parameters at each end. And
# the output layer's result, the logits, has one value per token of the vocabulary *for every token
# of the batch*: for one sequence of 8,192 tokens, 8,192 x 128,256 values, 4.2 GB in float32.
#
# Notebook 14b split the blocks of a GPT column-wise and row-wise. This lesson splits the two ends by
# vocabulary, with PyTorch's own tensor-parallel styles:
#
# - **The output layer, column-wise** (`ColwiseParallel`): each rank holds `V/N` of the columns and
#   makes `V/N` of every token's logits. The cross-entropy needs, for each token, the log of a sum over
#   *all* `V` logits. Gathering them (an all-gather of the whole logits) is one way; computing the
#   cross-entropy on the shards, **loss parallelism** (`torch.distributed.tensor.parallel.loss_parallel`),
#   is the other.
# - **The embedding, row-wise** (`RowwiseParallel` on an `nn.Embedding`): each rank holds `V/N` of the
#   rows; a token whose row another rank holds gives a vector of zeros, and an all-reduce adds the
#   ranks' vectors.
#
# We train the same small model three ways: on one process, with the logits gathered, and loss
# parallel; and watch every collective with `distlab.watch`.

# %%
# %load_ext distlab
# %dist start -n 2

# %%
import distlab
from distlab import theory

lab = distlab.current_lab()

# %% [markdown]
# ## The model
#
# An embedding of a 32,768-token vocabulary at width 64, one hidden layer, and an output layer back to
# the vocabulary; a batch of 4 sequences of 64 tokens. Its logits are 4 x 64 x 32,768 float32 values:
# 32 MiB, where the whole model is 16 MiB. Each rank makes the same batch and the same one-process
# reference, so the parallel runs can be compared with it exactly.

# %%
# %%ddp
import warnings
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

V, D, B, S = 32768, 64, 4, 64
mesh = init_device_mesh(device.type, (world_size,))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.body = nn.Linear(D, D)
        self.output = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.output(torch.tanh(self.body(self.embed(tokens))))


def make_model():
    torch.manual_seed(0)                                  # the same weights on every rank, and in the reference
    return TinyLM().to(device)


g = torch.Generator().manual_seed(1)
tokens = torch.randint(0, V, (B, S), generator=g).to(device)
labels = torch.randint(0, V, (B, S), generator=g).to(device)

reference = make_model()                                 # one process's answer: loss and gradients
reference_loss = F.cross_entropy(reference(tokens).flatten(0, 1), labels.flatten())
reference_loss.backward()

# %% [markdown]
# ## Predict first
#
# Gathered, the logits' all-gather leaves every rank with all 4 x 64 x 32,768 values; each rank already
# made half of them, so it receives the other half.

# %%
from distlab.quiz import predict

TOKENS, VOCAB = 4 * 64, 32768
guess = predict("2 ranks, the output layer split by vocabulary: to gather the logits of 4 x 64 tokens over a "
                "32,768-token vocabulary (float32), how many MiB does each rank receive?",
                theory="received_logits_bytes", unit="MiB", tolerance=0.1, tokens=TOKENS, vocab_size=VOCAB, tp=2)
guess

# %% [markdown]
# **Then measure.** `train(loss_parallel_)` parallelizes a fresh model: the embedding row-wise, the
# output layer column-wise. With the logits gathered, the output layer's plan asks for a replicated
# output (`output_layouts=Replicate()`), so it ends in an all-gather, and the cross-entropy is the
# ordinary one. With loss parallelism the output stays a DTensor sharded on its last dimension
# (`Shard(-1)`, `use_local_output=False`), and the cross-entropy and its backward run inside
# `with loss_parallel():`, which gives DTensor a sharded cross-entropy. `distlab.watch` records each
# step's collectives, op and size (for an all-gather, the size of the whole result).

# %%
# %%ddp
# distlab.watch follows every module's backward with a hook; torch warns when a module's inputs need
# no gradient (the embedding's token ids). Nothing is wrong: silence that one warning.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def train(loss_parallel_, steps=2):
    model = make_model()
    output = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if loss_parallel_ else
              ColwiseParallel(output_layouts=Replicate()))
    parallelize_module(model, mesh, {"embed": RowwiseParallel(input_layouts=Replicate()), "output": output})
    opt = torch.optim.SGD(model.parameters(), lr=0.0)    # lr 0: every step sees the same weights
    watch = distlab.watch(model, stats_every=0, checksum_every=0, publish=False)
    for _ in range(steps):
        opt.zero_grad()
        logits = model(tokens)
        if loss_parallel_:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        opt.step()
    watch.close()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t   # noqa: E731
    return {
        "collectives": [(c["op"], c["bytes"]) for c in watch.records()[-1]["collectives"]],
        "logits on this rank": tuple((logits.to_local() if hasattr(logits, "to_local") else logits).shape),
        "embedding rows on this rank": model.embed.weight.to_local().shape[0],
        "loss": full(loss).item(),
        "reference loss": reference_loss.item(),
        "loss error": abs(full(loss).item() - reference_loss.item()),
        "output grad error": (full(model.output.weight.grad) - reference.output.weight.grad).abs().max().item(),
        "embedding grad error": (full(model.embed.weight.grad) - reference.embed.weight.grad).abs().max().item(),
    }


runs = {"logits gathered": train(False), "loss parallel": train(True)}

# %%
runs = lab.pull("runs")
MiB = 2**20
for name, r in runs[0].items():
    print(f"{name}: logits on each rank {r['logits on this rank']}, embedding rows on each rank "
          f"{r['embedding rows on this rank']:,} of {VOCAB:,}")
    for op, size in r["collectives"]:
        print(f"    {op:<11} {size:>12,} bytes ({size / MiB:.3f} MiB)")
    print(f"    loss {r['loss']:.6f}, one process's {r['reference loss']:.6f}; largest gradient "
          f"difference from one process: output {r['output grad error']:.1e}, embedding {r['embedding grad error']:.1e}")
gathered = [size for op, size in runs[0]["logits gathered"]["collectives"] if op == "all_gather"]
received = sum(theory.collective_bytes("all_gather", size, 2).received_bytes for size in gathered)
print(f"\nthe all-gather the ranks recorded is the whole logits; each rank made half, so it received the other "
      f"{received / MiB:.1f} MiB. Loss parallel's three small all-reduces: "
      f"{theory.received_logits_bytes(TOKENS, VOCAB, 2, loss_parallel=True):,.0f} bytes received")

# %%
guess.reveal(received)

# %% tags=["nbval-check-output"]
LOGITS = TOKENS * VOCAB * 4
gathered_run, parallel_run = runs[0]["logits gathered"], runs[0]["loss parallel"]
print("gathered: one all-gather, of the whole logits:", gathered == [LOGITS])
print("loss parallel: no all-gather, and three all-reduces of one float a token:",
      [op for op, _ in parallel_run["collectives"]].count("all_gather") == 0
      and sum(size == TOKENS * 4 for op, size in parallel_run["collectives"] if op == "all_reduce") == 3)
print("loss parallel keeps half of every token's logits on each rank:", parallel_run["logits on this rank"] == (4, 64, VOCAB // 2))
print("the embedding's rows split in two, its vectors summed by an all-reduce of 4 x 64 x 64 floats:",
      all(r["embedding rows on this rank"] == VOCAB // 2 and ("all_reduce", TOKENS * 64 * 4) in r["collectives"]
          for r in runs[0].values()))
print("both ways, every rank: the loss and the gradients of one process (to 1e-5):",
      all(r[k] < 1e-5 for ranks in runs.values() for r in ranks.values()
          for k in ("loss error", "output grad error", "embedding grad error")))

# %% [markdown]
# ## How loss parallelism computes on shards
#
# For one token with logits `x` (all `V` of them) and target `t`, the cross-entropy is
# `log(sum_j exp(x_j)) - x_t`. Written so that nothing overflows, `m + log(sum_j exp(x_j - m)) - x_t`
# with `m = max_j x_j`. Each part is a reduction over the vocabulary, which a rank can do on its own
# slice first:
#
# 1. each rank's largest logit, then an all-reduce with MAX: `m`;
# 2. each rank's `sum exp(x_j - m)` over its slice, then an all-reduce with SUM;
# 3. the target's logit `x_t`: the rank whose slice holds `t` contributes it, the others 0, then SUM.
#
# Three all-reduces of one value a token, which is what the ranks recorded: 1,024 bytes each for 256
# tokens. The backward needs no communication for the logits: the gradient of the loss for logit `j`
# is `softmax(x)_j - [j = t]`, and each rank has what it needs for its own `j`. (The all-reduce of
# 65,536 bytes in the backward of both runs is the output layer's input gradient, a `Partial` sum over
# the vocabulary's shards, as in any column-wise layer.)
#
# At Llama 3 8B's size, tensor parallel over 8 GPUs, one sequence of 8,192 tokens in bfloat16: gathering
# the logits would make each GPU receive (7/8) x 8,192 x 128,256 x 2 bytes:

# %%
print(f"gathered: {theory.received_logits_bytes(8192, 128_256, 8, 2) / 1e9:.2f} GB received by each GPU; "
      f"loss parallel: {theory.received_logits_bytes(8192, 128_256, 8, 2, loss_parallel=True) / 1e3:.0f} KB")

# %% [markdown]
# and each GPU would hold the whole 2.1 GB of logits (and the log-softmax the cross-entropy keeps for
# its backward, the same size) instead of an eighth. torchtitan trains its tensor-parallel Llamas with `loss_parallel`
# for this reason (its `parallelism.disable_loss_parallel` setting turns it off).
#
# ## Practice

# %%
# %quiz model-parallelism -n 2 --seed 14

# %% [markdown]
# ## Build it yourself
#
# The exercise for tensor parallelism (notebook [17](17-exercises.ipynb) introduces them; each is graded on
# ranks the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise tensor-parallel-mlp`: Megatron's MLP by hand, the first layer column-parallel and the
#   second row-parallel, one all-reduce in the forward and one in the backward, checked against the
#   whole MLP on one process.

# %%
# %dist stop
