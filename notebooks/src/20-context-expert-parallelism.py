# %% [markdown]
# # 20 · Context and expert parallelism: splitting the tokens
#
# Data parallelism splits the batch, and tensor and pipeline parallelism split the model. The two
# ways in this lab split the *tokens* of one batch instead:
#
# - **Context parallelism** splits a long sequence over the ranks. Attention is the hard part,
#   because every query needs every key before it. **Ring attention** (Liu et al. 2023) keeps each
#   rank's queries in place and passes the keys and values around the ring, one rank's part per
#   step. Each rank combines the pieces with the same running softmax that FlashAttention uses
#   (Dao et al. 2022).
# - **Expert parallelism** gives each rank one expert of a mixture-of-experts layer (Lepikhin et
#   al. 2020, GShard; Fedus et al. 2021, Switch). A router picks an expert for each token. An
#   **all-to-all** sends each token to its expert's rank (dispatch), and a second one brings the
#   results back (combine).
#
# Both are built here by hand from `torch.distributed`'s point-to-point ops and all-to-all, on 4
# ranks. torch's own `context_parallel` has no sharding rule for the CPU's attention kernel, so on
# CPU ranks it cannot run. Each part is checked against one process computing the same thing whole.

# %%
# %load_ext distlab
# %dist start -n 4

# %%
import distlab
from distlab import theory

lab = distlab.current_lab()

# %% [markdown]
# ## Ring attention
#
# The sequence of `L` tokens is cut into chunks. Rank r keeps its chunk's queries, keys and values.
# Each of the N steps does two things at once:
#
# - it computes its queries against the keys and values it holds now;
# - it sends those keys and values to rank r+1 and receives rank r-1's (`batch_isend_irecv`, posted
#   before the compute so that the two overlap).
#
# After N steps every query has met every key. Each step's scores are folded into a running maximum,
# sum and weighted sum, as in FlashAttention. The result is softmax attention exactly, up to
# rounding, though no rank ever holds the whole `L x L` score matrix.
#
# With a **causal** mask a query attends only to keys at or before it. A chunk of keys that lies
# wholly in a chunk of queries' future is skipped. A chunk on the diagonal is computed whole, then
# masked. So the ranks' work differs:
#
# - **Contiguous chunks**: rank 0 holds the start of the sequence and skips almost everything; rank
#   N-1 computes against every chunk.
# - **Zigzag**: the sequence is cut into 2N chunks, and rank r takes chunks r and 2N-1-r, one from
#   each end. This evens the work out. torch's `context_parallel` balances its ring this way, and
#   Llama 3 split its sequences into the same 2N chunks (Dubey et al. 2024, section 3.3.2), though
#   it did not pass K and V round a ring: each rank all-gathered them, then attended its queries to
#   all the keys.
#
# **Predict first**, for a sequence of 2,048 tokens on 4 ranks with contiguous chunks: how many times
# the mean number of query-key pairs does the busiest rank compute? (The widget grades your guess
# against the theory; the ranks' own count comes after they run.)

# %%
from distlab.quiz import predict

L = 2048
guess = predict("Contiguous chunks, 4 ranks, causal attention: the busiest rank's query-key pairs over the mean?",
                theory="causal_load_imbalance", tolerance=0.05, ranks=4, layout="contiguous")
guess

# %% [markdown]
# The ranks run the code below. Every rank makes the same `q`, `k` and `v` for the whole sequence
# from one seed, so that each can check its part against one-process attention, and then takes its
# own chunks' rows. Each rank also counts the query-key pairs it computed.

# %%
# %%ddp
import math
import time

import torch.nn.functional as F
from distlab.telemetry import track_memory

B, H, L, D = 1, 4, 2048, 32
torch.manual_seed(0)                                     # the same whole sequence on every rank
q_all, k_all, v_all = (torch.randn(B, H, L, D).to(device) for _ in range(3))


def chunks_of(layout):
    """The positions this rank holds: one contiguous chunk, or a chunk from each end (zigzag)."""
    if layout == "contiguous":
        n = L // world_size
        return [torch.arange(rank * n, (rank + 1) * n, device=device)]
    n = L // (2 * world_size)
    return [torch.arange(c * n, (c + 1) * n, device=device) for c in (rank, 2 * world_size - 1 - rank)]


def ring_attention(layout):
    """Causal attention for this rank's queries; keys and values go round the ring.
    (out, positions, pairs, each query's log-sum-exp of scores: what the backward needs)"""
    mine = chunks_of(layout)
    pos = torch.cat(mine)
    q = q_all[:, :, pos]
    m = torch.full((B, H, len(pos), 1), -math.inf, device=device)    # running max of each query's scores
    s_sum = torch.zeros(B, H, len(pos), 1, device=device)              # running sum of exp(score - max)
    acc = torch.zeros(B, H, len(pos), D, device=device)                # running sum of exp(...) * value
    kv, kv_pos = torch.stack([k_all[:, :, pos], v_all[:, :, pos]]), pos.clone()
    pairs, size = 0, len(mine[0])
    for step in range(world_size):
        if step < world_size - 1:                        # the next hop, posted before the compute
            nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
            kv_in, pos_in = torch.empty_like(kv), torch.empty_like(kv_pos)
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, kv_in, prv),
                dist.P2POp(dist.isend, kv_pos, nxt), dist.P2POp(dist.irecv, pos_in, prv)])
        for qc, qpos in enumerate(mine):
            rows = slice(qc * size, (qc + 1) * size)
            for kc in range(len(kv_pos) // size):
                cols = slice(kc * size, (kc + 1) * size)
                kpos = kv_pos[cols]
                if kpos[0] > qpos[-1]:
                    continue                             # all in this query chunk's future: skipped
                s = q[:, :, rows] @ kv[0][:, :, cols].transpose(-2, -1) / math.sqrt(D)
                if kpos[-1] > qpos[0]:                   # the diagonal: mask the future
                    s = s.masked_fill(qpos[:, None] < kpos[None, :], -math.inf)
                pairs += s.shape[-2] * s.shape[-1]
                m_new = torch.maximum(m[:, :, rows], s.amax(-1, keepdim=True))
                rescale, p = torch.exp(m[:, :, rows] - m_new), torch.exp(s - m_new)
                acc[:, :, rows] = acc[:, :, rows] * rescale + p @ kv[1][:, :, cols]
                s_sum[:, :, rows] = s_sum[:, :, rows] * rescale + p.sum(-1, keepdim=True)
                m[:, :, rows] = m_new
        if step < world_size - 1:
            for work in works:
                work.wait()
            kv, kv_pos = kv_in, pos_in
    return acc / s_sum, pos, pairs, m + torch.log(s_sum)


def naive_attention():
    """The whole sequence in one process, every score kept: what ring attention splits up."""
    s = q_all @ k_all.transpose(-2, -1) / math.sqrt(D)
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=device).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v_all


reference = F.scaled_dot_product_attention(q_all, k_all, v_all, is_causal=True)
ring = {}
for layout in ("contiguous", "zigzag"):
    ring_attention(layout)                               # warm up: the first send opens the connections
    took = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        out, pos, pairs, _ = ring_attention(layout)
        took.append(time.perf_counter() - t0)
    ring[layout] = {"apart": (out - reference[:, :, pos]).abs().max().item(), "pairs": pairs,
                    "seconds": sorted(took)[1]}

# %%
ring = lab.pull("ring")
print(f"{'layout':<11} {'rank':>4} {'pairs':>10} {'theory':>10} {'max |ring - one process|':>25} {'time':>7}")
for layout in ("contiguous", "zigzag"):
    expected = theory.ring_attention_pairs(L, 4, layout)
    for r in range(4):
        got = ring[r][layout]
        print(f"{layout:<11} {r:>4} {got['pairs']:>10,} {expected[r]:>10,} {got['apart']:>25.1e} "
              f"{got['seconds']:>6.3f}s")

# %% [markdown]
# The outputs agree with one process's attention to float32's rounding (`F.scaled_dot_product_attention`,
# causal). The pairs each rank counted as it ran are the theory's, to the pair:

# %% tags=["nbval-check-output"]
for layout in ("contiguous", "zigzag"):
    expected = theory.ring_attention_pairs(L, 4, layout)
    print(f"{layout}: every rank's output matches one process to 1e-5:",
          all(ring[r][layout]["apart"] < 1e-5 for r in range(4)))
    print(f"{layout}: every rank computed the pairs theory says:",
          [ring[r][layout]["pairs"] for r in range(4)] == expected)

# %% [markdown]
# The theory's pairs per rank for both layouts, then your prediction against what the ranks counted:

# %%
for layout in ("contiguous", "zigzag"):
    pairs = theory.ring_attention_pairs(L, 4, layout)
    print(f"{layout:<11} pairs per rank: {', '.join(f'{p:,}' for p in pairs)}; "
          f"busiest / mean: {theory.causal_load_imbalance(4, layout):.2f}")
counted = [ring[r]["contiguous"]["pairs"] for r in range(4)]
guess.reveal(max(counted) / (sum(counted) / 4))

# %% [markdown]
# With contiguous chunks the last rank computes 4 times the first rank's pairs, and 1.6 times the
# mean. A ring step ends when its slowest rank has received and computed, so the others wait. Zigzag
# gives every rank the same work, and fewer pairs in all: smaller chunks skip more of the masked
# future.
#
# The times above come from 4 ranks sharing this machine's cores. A rank that waits leaves its core
# to a busy one, so the machine hides part of the imbalance that separate GPUs would show in full.
# The counts are what a GPU per rank would feel.
#
# **Memory.** One process computing naive attention keeps the whole `L x L` matrix of scores, and its
# softmax, for every head. A ring rank holds at most one chunk's scores against one chunk of keys at
# a time. `track_memory` measures the most bytes of tensors alive at once while each runs:

# %%
# %%ddp
memory = {}
with track_memory() as mem:
    naive_attention()
memory["one process, naive"] = mem.peak_bytes
for layout in ("contiguous", "zigzag"):
    with track_memory() as mem:
        ring_attention(layout)
    memory[f"ring, {layout}"] = mem.peak_bytes

# %%
memory = lab.pull("memory")
scores = 4 * 1 * 4 * L * L                               # float32 x B x H x L x L: one score matrix
print(f"one L x L score matrix for 4 heads: {scores / 2**20:.0f} MiB")
for name in memory[0]:
    print(f"{name:<20} peak per rank: " + ", ".join(f"{memory[r][name] / 2**20:6.1f}" for r in range(4)) + " MiB")

# %% tags=["nbval-check-output"]
naive_peak = memory[0]["one process, naive"]
print("naive attention holds at least one whole score matrix:", naive_peak >= scores)
print("every ring rank's peak is under a quarter of naive attention's:",
      all(memory[r][f"ring, {lay}"] < naive_peak / 4 for r in range(4) for lay in ("contiguous", "zigzag")))

# %% [markdown]
# The peak falls by more than the number of ranks. The score block of one step is `(L/N)^2` rather
# than `L^2`, so it shrinks with the square of N; what a rank keeps for the whole run (its queries,
# the running sums, the output) shrinks as 1/N. Fused kernels such as FlashAttention never hold the
# score matrix either, even in one process. What they cannot do is hold a sequence too long for one
# device's memory: keys, values and activations grow with `L`, and context parallelism divides them
# by N.
#
# ## All-to-all instead of a ring: Ulysses
#
# DeepSpeed-Ulysses (Jacobs et al. 2023) splits the sequence the same way but never passes keys round
# a ring. Attention is computed head by head, and heads are independent, so one **all-to-all** trades
# the split: each rank sends every other rank that rank's share of the heads for its own chunk, and
# ends with `H/N` heads of the **whole** sequence. It computes ordinary causal attention for those
# heads, and a second all-to-all trades back. Four all-to-alls in all (q, k, v in; the output back),
# each moving `(N-1)/N` of a rank's `B x H x L/N x D` block. The ring instead sends its block of k and
# v on `N-1` hops. So per rank the ring sends `(N-1) x 2` blocks and Ulysses `4 (N-1)/N`: `N/2` times
# less for Ulysses, a saving that grows with N. Its limit: `N` cannot exceed the number of heads (of
# key-value heads, with grouped-query attention). The third form, all-gathering k and v once (Llama 3,
# above), sends what the ring sends, at once rather than hop by hop.
#
# **Predict first**: on these 4 ranks, how many times Ulysses' bytes does a rank send in ring
# attention?

# %%
def ring_over_ulysses(ranks=4):
    """Blocks a rank sends: the ring's k and v on N-1 hops, 2(N-1); Ulysses' four all-to-alls, 4(N-1)/N."""
    return 2 * (ranks - 1) / (4 * (ranks - 1) / ranks)


ulysses_guess = predict("Context parallelism on 4 ranks: a rank's bytes sent in ring attention over its bytes in "
                        "Ulysses (all-to-all over heads)?", theory=ring_over_ulysses, unit="x", tolerance=0.05)
ulysses_guess

# %%
# %%ddp
def ulysses_attention():
    """Causal attention for this rank's contiguous chunk: heads traded by all-to-all. (out, positions, bytes sent)"""
    n, h = L // world_size, H // world_size
    pos = torch.arange(rank * n, (rank + 1) * n, device=device)

    def to_heads(t):
        """(B, H, n, D), my chunk of every head -> (B, h, L, D), my heads of the whole sequence."""
        send = t.reshape(B, world_size, h, n, D).transpose(0, 1).contiguous()   # block j: rank j's heads
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send)                                      # block i: rank i's chunk
        return got.permute(1, 2, 0, 3, 4).reshape(B, h, L, D)

    def to_sequence(t):
        """(B, h, L, D) -> (B, H, n, D): back to my chunk of every head."""
        send = t.reshape(B, h, world_size, n, D).permute(2, 0, 1, 3, 4).contiguous()   # block i: chunk i
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send)                                      # block j: rank j's heads
        return got.permute(1, 0, 2, 3, 4).reshape(B, H, n, D)

    q, k, v = (to_heads(t[:, :, pos]) for t in (q_all, k_all, v_all))
    return to_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=True)), pos, tuple(q.shape)


class Sent:
    """Counts the bytes this rank hands to other ranks: in an all-to-all all but its own block, and
    every tensor of an isend in batch_isend_irecv (the ring's)."""

    def __enter__(self):
        self.bytes, self._a2a, self._batch = 0, dist.all_to_all_single, dist.batch_isend_irecv

        def all_to_all_single(output, input, *args, **kwargs):
            self.bytes += input.numel() * input.element_size() * (world_size - 1) // world_size
            return self._a2a(output, input, *args, **kwargs)

        def batch_isend_irecv(ops):
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is self._isend)
            return self._batch(ops)

        self._isend = dist.isend
        dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.batch_isend_irecv = self._a2a, self._batch


with Sent() as by_ulysses:
    out, pos, heads_shape = ulysses_attention()
with Sent() as by_ring:
    ring_attention("contiguous")
ulysses = {"apart": (out - reference[:, :, pos]).abs().max().item(), "sent": by_ulysses.bytes,
           "ring sent": by_ring.bytes, "heads shape": heads_shape}

# %%
ulysses = lab.pull("ulysses")
for r in range(4):
    u = ulysses[r]
    print(f"rank {r}: attends {u['heads shape'][1]} head(s) over all {u['heads shape'][2]:,} positions; "
          f"sends {u['sent'] / 2**20:.2f} MiB (ring: {u['ring sent'] / 2**20:.2f} MiB); "
          f"max |Ulysses - one process| {u['apart']:.1e}")
ulysses_guess.reveal(ulysses[0]["ring sent"] / ulysses[0]["sent"])

# %% tags=["nbval-check-output"]
print("Ulysses gives one process's causal attention on every rank, to 1e-5:",
      all(ulysses[r]["apart"] < 1e-5 for r in range(4)))
print("each rank attends H/N = 1 head over the whole sequence:",
      all(ulysses[r]["heads shape"] == (1, 1, 2048, 32) for r in range(4)))
print("the ring sends N/2 = 2 times Ulysses' bytes (its keys' positions add 1%):",
      all(2 <= ulysses[r]["ring sent"] / ulysses[r]["sent"] < 2.05 for r in range(4)))

# %% [markdown]
# The bytes are counted as each rank handed its tensors to the collectives (`Sent` wraps
# `all_to_all_single` and `batch_isend_irecv` while each runs): the ring also sends its keys'
# positions, a few KiB. Ulysses needs no
# causal balancing either: every rank attends its heads over the whole sequence, so every rank does
# the same work. What it gives up: each rank holds the whole sequence for its heads during attention,
# and the all-to-alls cross every pair of ranks, where a ring only talks to its neighbours. torch's
# `context_parallel` runs the ring (or the all-gather, `set_rotate_method("allgather")`); notebook 23
# predicts context parallelism's cost at 1,024 GPUs.
#
# ## The ring's backward: dK and dV travel too
#
# Training needs the gradients. A rank holds its queries, so it can add up their gradient `dQ` at
# home. But the gradient of a key and value block gathers contributions from **every** rank whose
# queries attended to it. So in the backward each block of `K` and `V` travels the ring again,
# carrying its `dK` and `dV`: every rank it visits adds its queries' part. After `N` hops (one more
# than the forward) the block is back at its owner with its gradients complete. Each rank needs from
# the forward only its output and each query's log-sum-exp of scores (FlashAttention's backward
# recomputes the probabilities from them; `ring_attention` above returns both):
#
# - `P = exp(S - lse)`, recomputed block by block from `Q K^T`;
# - `dV += P^T dO`; `dS = P * (dO V^T - rowsum(dO * O))`;
# - `dQ += dS K / sqrt(D)`; `dK += dS^T Q / sqrt(D)`.
#
# Each backward hop carries four blocks (K, V, dK, dV) where the forward's carried two.
#
# **Predict first**: contiguous chunks on 4 ranks. How many times the forward's bytes does a rank send
# in the backward?

# %%
def backward_over_forward(ranks=4):
    """Forward: k and v on N-1 hops. Backward: k, v, dk and dv on N hops (the last brings dk, dv home)."""
    return 4 * ranks / (2 * (ranks - 1))


backward_guess = predict("Ring attention on 4 ranks: a rank's bytes sent in the backward over the forward's?",
                         theory=backward_over_forward, unit="x", tolerance=0.05)
backward_guess

# %%
# %%ddp
def ring_pass(blocks):
    """One hop: these tensors to the next rank, the previous rank's received in their place."""
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    got = [torch.empty_like(b) for b in blocks]
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, b, nxt) for b in blocks] +
                                   [dist.P2POp(dist.irecv, g, prv) for g in got])
    for work in works:
        work.wait()
    return got


def masked_scores(q, k, qpos, kpos):
    s = q @ k.transpose(-2, -1) / math.sqrt(D)
    return s.masked_fill(qpos[:, None] < kpos[None, :], -math.inf)


def ring_backward(q, k, v, pos, out, lse, dout):
    """dQ at home; K and V travel with their dK and dV, N hops, back to their owner."""
    delta = (dout * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    blocks = [k, v, torch.zeros_like(k), torch.zeros_like(v), pos]
    for _ in range(world_size):
        kk, vv, dk, dv, kpos = blocks
        if kpos[0] <= pos[-1]:
            p = torch.exp(masked_scores(q, kk, pos, kpos) - lse)
            dv += p.transpose(-2, -1) @ dout
            ds = p * (dout @ vv.transpose(-2, -1) - delta)
            dq += ds @ kk / math.sqrt(D)
            dk += ds.transpose(-2, -1) @ q / math.sqrt(D)
        blocks = ring_pass(blocks)
    return dq, blocks[2], blocks[3]


torch.manual_seed(1)
dout_all = torch.randn(B, H, L, D).to(device)            # the gradient arriving at the output, the same everywhere
whole = [t.clone().requires_grad_() for t in (q_all, k_all, v_all)]
F.scaled_dot_product_attention(*whole, is_causal=True).backward(dout_all)
with Sent() as forward_sent:
    out, pos, _, lse = ring_attention("contiguous")     # the forward above, contiguous chunks
q, k, v = (t[:, :, pos] for t in (q_all, k_all, v_all))
with Sent() as backward_sent:
    grads = ring_backward(q, k, v, pos, out, lse, dout_all[:, :, pos])
ring_grads = {"apart": {name: (g - w.grad[:, :, pos]).abs().max().item() for name, g, w in zip(("dQ", "dK", "dV"), grads, whole)},
              "forward sent": forward_sent.bytes, "backward sent": backward_sent.bytes}

# %%
ring_grads = lab.pull("ring_grads")
for r in range(4):
    g = ring_grads[r]
    print(f"rank {r}: largest difference from autograd on one process: " +
          ", ".join(f"{name} {d:.1e}" for name, d in g["apart"].items()) +
          f"; sent {g['forward sent'] / 2**20:.2f} MiB forward, {g['backward sent'] / 2**20:.2f} MiB backward")
backward_guess.reveal(ring_grads[0]["backward sent"] / ring_grads[0]["forward sent"])

# %% tags=["nbval-check-output"]
print("dQ, dK and dV of every rank's chunk are one process's, to 1e-4:",
      all(d < 1e-4 for r in range(4) for d in ring_grads[r]["apart"].values()))
print("the backward sends 2N/(N-1) = 2.67 times the forward's bytes (the positions ride along):",
      all(2.6 < ring_grads[r]["backward sent"] / ring_grads[r]["forward sent"] < 2.7 for r in range(4)))

# %% [markdown]
# Every gradient is the one autograd gives on the whole sequence in one process, and the backward
# moves `2N/(N-1)` times the forward's bytes: twice the blocks, one hop more. So a context-parallel
# step sends 3.67 times the forward's traffic in all (1 + 2.67), the traffic a chunk's compute has
# to hide: the transfer of a block hides behind its attention when computing one
# block of `(L/N)^2` scores takes longer than moving it.
#
# ## Expert parallelism
#
# A mixture-of-experts layer replaces one MLP with E of them. A small **router** (a linear layer
# and a softmax) picks one expert per token (top-1, as in Switch), and the expert's output is scaled
# by the router's probability. Here E = 4 experts sit one per rank, and each rank has its own 256
# tokens.
#
# An expert has a fixed number of slots per batch, its **capacity**, as the Switch Transformer
# defines it (Fedus et al. 2021, section 2.2): `capacity_factor * tokens / experts` (GShard's top-2
# routing gives each expert about `2 * tokens / experts`). Tokens routed to a full expert are **dropped**: the layer
# passes them on unchanged (here, as zeros, the residual connection that would carry them is left
# out). Fixed slots give the all-to-all a fixed shape. Each rank sends E x capacity rows, one block
# per expert, padded where there are fewer tokens.
#
# The capacity at four factors, with 256 tokens per rank and 4 experts, by the Switch Transformer's
# definition above (the ranks count what a biased router drops below):

# %%
for cf in (1.0, 1.25, 2.0, 4.0):
    print(f"capacity factor {cf}: {theory.expert_capacity(256, 4, cf)} slots per expert per rank")

# %% [markdown]
# At a factor of 1 a router that spreads the tokens perfectly evenly fills every slot, and any
# imbalance drops tokens. The router below is untrained, with a bias towards expert 0, as an
# unbalanced router would be. `moe_local` computes the layer in one process with every expert there.
# `moe_parallel` is expert parallelism: one expert per rank, and two all-to-alls. It uses the
# functional collective `all_to_all_single_autograd` (torch's; torchtitan's expert dispatch calls it
# too; DTensor's Shard-to-Shard redistribution has its own, `shard_dim_alltoall`, as notebook 14b
# shows), whose backward is an all-to-all too, so the layer trains.

# %%
# %%ddp
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from distlab import theory

E, DIM, HIDDEN, T = world_size, 64, 128, 256


def make_router():
    torch.manual_seed(1)
    router = nn.Linear(DIM, E).to(device)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.6, 0.0, 0.0, -0.3], device=device))   # expert 0 is popular
    return router.requires_grad_(False)


def make_expert(e):
    torch.manual_seed(100 + e)                          # expert e starts the same wherever it is made
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)).to(device)


def route(router, x, capacity):
    """Top-1 routing: each token's expert and gate, and its slot there (-1: dropped, the expert was full)."""
    gate, expert = torch.softmax(router(x), dim=-1).max(dim=-1)
    slot = torch.full_like(expert, -1)
    for e in range(E):
        queue = (expert == e).nonzero().flatten()
        slot[queue[:capacity]] = torch.arange(min(capacity, len(queue)), device=device)   # first come, first served
    return expert, gate, slot


def moe_local(router, experts, x, capacity):
    """One process, every expert here: the reference."""
    expert, gate, slot = route(router, x, capacity)
    out = torch.zeros_like(x)
    for e in range(E):
        kept = (expert == e) & (slot >= 0)
        out[kept] = experts[e](x[kept]) * gate[kept, None]
    return out


def moe_parallel(router, my_expert, x, capacity):
    """Expert parallelism: each token to its expert's rank and back, by two all-to-alls."""
    expert, gate, slot = route(router, x, capacity)
    kept = slot >= 0
    send = x.new_zeros(E, capacity, DIM)                # block e: the tokens for expert e, padded
    send[expert[kept], slot[kept]] = x[kept]
    received = all_to_all_single_autograd(send.flatten(0, 1), None, None, dist.group.WORLD)   # dispatch
    done = my_expert(received)                          # this rank's expert on every rank's tokens for it
    back = all_to_all_single_autograd(done, None, None, dist.group.WORLD).view(E, capacity, DIM)  # combine
    out = torch.zeros_like(x)
    out[kept] = back[expert[kept], slot[kept]] * gate[kept, None]
    return out


router = make_router()
xs = [torch.randn(T, DIM, generator=torch.Generator().manual_seed(r)).to(device) for r in range(world_size)]
x = xs[rank]
experts = [make_expert(e) for e in range(E)]            # for the reference only
routing, apart = {}, {}
for cf in (1.0, 1.25, 2.0, 4.0):
    capacity = theory.expert_capacity(T, E, cf)
    expert, _, slot = route(router, x, capacity)
    routing[cf] = (torch.bincount(expert, minlength=E).tolist(), int((slot < 0).sum()))
    with torch.no_grad():
        apart[cf] = (moe_parallel(router, experts[rank], x, capacity) - moe_local(router, experts, x, capacity)).abs().max().item()

# %%
routing, apart = lab.pull("routing"), lab.pull("apart")
print(f"{'factor':>6} {'slots':>5}   tokens routed to experts 0-3 (all ranks)   dropped   max |parallel - one process|")
for cf in (1.0, 1.25, 2.0, 4.0):
    routed = [sum(routing[r][cf][0][e] for r in range(4)) for e in range(4)]
    dropped = sum(routing[r][cf][1] for r in range(4))
    print(f"{cf:>6} {theory.expert_capacity(256, 4, cf):>5}   {str(routed):<40} "
          f"{dropped:>4} of 1024   {max(apart[r][cf] for r in range(4)):.1e}")

# %% tags=["nbval-check-output"]
drops = [sum(routing[r][cf][1] for r in range(4)) for cf in (1.0, 1.25, 2.0, 4.0)]
print("expert parallelism gives one process's output, on every rank, at every factor:",
      all(apart[r][cf] < 1e-6 for r in range(4) for cf in (1.0, 1.25, 2.0, 4.0)))
print("fewer tokens dropped as the factor grows:", drops == sorted(drops, reverse=True) and drops[0] > drops[-1])
print("at a factor of 4 (every token's slot guaranteed) none is dropped:", drops[-1] == 0)

# %% [markdown]
# The router sends more than half of the tokens to expert 0 (609 of 1,024 in the run saved here,
# over twice an even share), so at a factor of 1 that expert overflows and its late tokens are
# dropped. A larger factor drops fewer and pads more. The padding
# is sent too: every all-to-all carries E x capacity rows from each rank, whether full or not.
# Trained routers add a load-balancing loss to keep the experts evenly used (Switch), so that a
# small factor (1 to 1.25 in Switch) drops little.
#
# **Training, watched.** Each rank trains its own expert for three steps of SGD at a factor of
# 1.25, on a target of its own. The tokens' input requires a gradient, as it would with layers
# below, so the backward pass sends the gradients back through both all-to-alls.
# `distlab.watch` records every collective of a step with its size (`replicated=False` tells it
# that the ranks' experts differ on purpose, so it compares no replicas). Each all-to-all's buffer is
# `E x capacity x DIM` float32 numbers, and each rank sends (N-1)/N of it to the others
# (`theory.collective_bytes("all_to_all", ...)`).
#
# Rank 0 then trains all four experts in one process on all the ranks' tokens. Its loss is the mean
# of the ranks' losses, so its gradients are the parallel run's, and its experts must end where the
# ranks' experts end.

# %%
# %%ddp
class MoE(nn.Module):
    def __init__(self, expert, capacity):
        super().__init__()
        self.expert, self.capacity = expert, capacity

    def forward(self, x):
        return moe_parallel(router, self.expert, x, self.capacity)


capacity = theory.expert_capacity(T, E, 1.25)
targets = [torch.randn(T, DIM, generator=torch.Generator().manual_seed(50 + r)).to(device) for r in range(world_size)]
layer = MoE(make_expert(rank), capacity).to(device)
opt = torch.optim.SGD(layer.parameters(), lr=0.5)
watch = distlab.watch(layer, stats_every=0, checksum_every=0, replicated=False)   # each expert is its own
for step in range(3):
    inputs = x.clone().requires_grad_()                 # as if layers below wanted its gradient
    loss = ((layer(inputs) - targets[rank]) ** 2).mean() / world_size   # the mean over the ranks' losses
    loss.backward()
    opt.step()
    opt.zero_grad()
watch.close()
step_collectives = [(c["op"], c["bytes"], c["ranks"]) for c in watch.records()[-1]["collectives"]]

# One process, every expert: the same three steps on all the ranks' tokens.
experts = [make_expert(e) for e in range(E)]
one_opt = torch.optim.SGD([p for e in experts for p in e.parameters()], lr=0.5)
for step in range(3):
    loss = sum(((moe_local(router, experts, xs[r], capacity) - targets[r]) ** 2).mean() for r in range(world_size)) / world_size
    loss.backward()
    one_opt.step()
    one_opt.zero_grad()
weights_apart = max((a - b).abs().max().item() for a, b in zip(layer.expert.parameters(), experts[rank].parameters()))

# %%
step_collectives, weights_apart = lab.pull("step_collectives"), lab.pull("weights_apart")
capacity = theory.expert_capacity(256, 4, 1.25)
buffer = 4 * capacity * 64 * 4                          # E x capacity x DIM float32
sent = theory.collective_bytes("all_to_all", buffer, 4).sent_bytes
print("rank 0's last step, as the watch recorded it:", step_collectives[0])
print(f"the model: 4 all-to-alls (dispatch and combine, forward and backward) of {buffer:,} bytes; "
      f"each rank sends {sent:,.0f} of them to the others")
print("largest difference of an expert's weights from one process's, per rank:",
      ", ".join(f"{weights_apart[r]:.1e}" for r in range(4)))

# %% tags=["nbval-check-output"]
print("each step: 4 all-to-alls over 4 ranks, each of the model's buffer, on every rank:",
      all(c == [("all_to_all", buffer, 4)] * 4 for c in step_collectives.values()))
print("each rank's expert ends as one process's, to 1e-6:", all(a < 1e-6 for a in weights_apart.values()))

# %% [markdown]
# Three steps of expert parallelism train the experts as one process holding them all would. The
# watch sees the four all-to-alls of each step. Their size is set by the capacity, not by how many
# tokens each expert really got.
#
# ## Dropless: the counts first, then exactly the tokens
#
# A capacity drops tokens when an expert is popular and sends padding when it is not. **Dropless**
# MoE (MegaBlocks, Gale et al. 2023; torchtitan's token dispatch) sends every routed token and
# nothing else. The price is a step more: no rank knows in advance how many tokens it will receive,
# so the ranks first exchange their **counts** (an all-to-all of E integers: how many tokens each
# rank sends each expert), then dispatch with an all-to-all of **variable splits**
# (`dist.all_to_all_single` with `input_split_sizes` and `output_split_sizes`), and combine with the
# same splits reversed. With **top-k** routing each token goes to k experts, its output the sum of
# theirs weighted by their gates: k times the rows to dispatch.
#
# **Predict first**: top-2 instead of top-1, dropless, 256 tokens on each of 4 ranks: how many rows
# does each rank dispatch in all (to itself included)?

# %%
def rows_dispatched(tokens=256, k=2):
    """Dropless top-k: each token's row goes to each of its k experts."""
    return k * tokens


rows_guess = predict("Dropless top-2 routing of 256 tokens on a rank: how many rows does it dispatch in all?",
                     theory=rows_dispatched, unit="", tolerance=0.001)
rows_guess

# %%
# %%ddp
def dropless(router, my_expert, x, k):
    """Every token to its k experts' ranks and back: counts first, then all-to-alls of variable splits."""
    gate, expert = torch.softmax(router(x), dim=-1).topk(k, dim=-1)          # (T, k) each
    order = expert.flatten().argsort(stable=True)                            # the rows, grouped by expert
    token = order // k                                                       # the token of each row
    send = x[token]
    counts = torch.bincount(expert.flatten(), minlength=E)                   # rows for each expert's rank
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts)                                 # 1. the counts
    received = x.new_empty(int(incoming.sum()), DIM)
    dist.all_to_all_single(received, send, incoming.tolist(), counts.tolist())   # 2. dispatch
    done = my_expert(received)
    back = x.new_empty(len(send), DIM)
    dist.all_to_all_single(back, done, counts.tolist(), incoming.tolist())   # 3. combine
    out = torch.zeros_like(x)
    out.index_add_(0, token, back * gate.flatten()[order, None])
    return out, counts.tolist(), int(incoming.sum())


def topk_local(router, experts, x, k):
    """One process, every expert here, nothing dropped: the reference."""
    gate, expert = torch.softmax(router(x), dim=-1).topk(k, dim=-1)
    out = torch.zeros_like(x)
    for j in range(k):
        for e in range(E):
            mine = expert[:, j] == e
            out[mine] += experts[e](x[mine]) * gate[mine, j, None]
    return out


experts = [make_expert(e) for e in range(E)]
dropless_runs = {}
with torch.no_grad():
    for k in (1, 2):
        out, counts, received = dropless(router, experts[rank], x, k)
        dropless_runs[k] = {"sent rows": counts, "received rows": received,
                            "apart": (out - topk_local(router, experts, x, k)).abs().max().item()}

# %%
dropless_runs = lab.pull("dropless_runs")
padded = 4 * theory.expert_capacity(256, 4, 1.25)                           # rows a capacity of 1.25 sends
for k in (1, 2):
    print(f"top-{k}, dropless:")
    for r in range(4):
        d = dropless_runs[r][k]
        print(f"  rank {r} sends {d['sent rows']} rows to experts 0-3 ({sum(d['sent rows'])} in all), "
              f"receives {d['received rows']}; largest difference from one process {d['apart']:.1e}")
print(f"a capacity of 1.25 sends {padded} rows from every rank, padding included, and drops the overflow")
rows_guess.reveal(sum(dropless_runs[0][2]["sent rows"]))

# %% tags=["nbval-check-output"]
print("dropless gives one process's output with nothing dropped, top-1 and top-2, on every rank:",
      all(dropless_runs[r][k]["apart"] < 1e-5 for r in range(4) for k in (1, 2)))
print("every rank dispatches k x 256 rows:", all(sum(dropless_runs[r][k]["sent rows"]) == 256 * k
                                                 for r in range(4) for k in (1, 2)))
print("what the ranks send, the ranks receive:", all(
    sum(dropless_runs[s][k]["sent rows"][r] for s in range(4)) == dropless_runs[r][k]["received rows"]
    for r in range(4) for k in (1, 2)))
print("the popular expert's rank receives the most:", all(
    max(range(4), key=lambda r: dropless_runs[r][k]["received rows"]) == 0 for k in (1, 2)))

# %% [markdown]
# Nothing is dropped and nothing is padded: each rank sends exactly its k x 256 rows, and the rank
# of the popular expert receives far more than the others, which is dropless's cost on the other
# side: that rank's expert has the most work, and the step waits for it (a load-balancing loss is
# still wanted). The counts' all-to-all is small, but the next buffers cannot be sized before it
# ends: on a GPU, `counts.tolist()` here is where the host waits for the device. Top-2 doubles the
# rows dispatched and combined; the Switch Transformer routes each token to one expert partly to
# halve this traffic (Fedus et al. 2021).
#
# ## Practice
#
# `%exercise expert-dispatch` asks you to write this layer's dispatch and combine yourself: the
# capacity, the two all-to-alls and the rows put back in place. It is graded on ranks of its own, at 2
# and 4 ranks, against one process holding every expert.

# %%
# %quiz model-parallelism -n 3 --seed 20

# %%
# %dist stop
