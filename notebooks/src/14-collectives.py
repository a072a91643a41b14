# %% [markdown]
# # 14 · Collectives
#
# Every way of splitting training over devices is built from a handful of **collectives**. Data
# parallelism all-reduces gradients (notebooks 01 and 03); ZeRO and FSDP reduce-scatter gradients and
# all-gather parameters (notebooks 06 and 15); tensor parallelism sums activations inside every layer
# (notebook 14b, the next one). This lab takes the five of them apart on 4 ranks, one per emulated node:
#
# * **1.** what each does, on tensors small enough to read;
# * **1.1** all-reduce rebuilt from reduce-scatter and all-gather, checked bit for bit (and where the
#   bits can differ);
# * **1.2** the bytes each rank sends and receives, counted on the links, next to `distlab.theory`.
#
# The nodes are network namespaces joined by links shaped to 1 Gbit/s, as in notebook 12, so that every
# byte a rank sends crosses a link whose counters we can read. Making nodes takes root's CAP_NET_ADMIN
# or, for a user without it, a user namespace of the lab's own, which most Linux machines allow. Where
# neither can be had (some containers, on Binder perhaps) the cell below says so and the ranks talk
# through loopback; the cells that count bytes on the links then show what they printed in the run on
# nodes this notebook was saved from, every line marked `saved |`.

# %%
# %load_ext distlab
import distlab
from distlab.cluster.nodes import nodes_here
from distlab.notebook.saved import saved_from_nodes

# True where emulated nodes can be made; elsewhere False, after one line saying why not
on_nodes = nodes_here("4 ranks on loopback instead, and no bytes counted on links")
saved = saved_from_nodes("14-collectives")   # without nodes: what the cells printed on them, marked saved
nodes = "--nodes 4 --link 1gbit" if on_nodes else ""

# %% [markdown]
# IPython fills `{nodes}` in before the magic runs: with nodes the line reads
# `%dist start -n 4 --nodes 4 --link 1gbit`, one rank on each node (rank r on `node<r>`).

# %%
# %dist start -n 4 {nodes}

# %% [markdown]
# ## 1. Five collectives
#
# On N ranks, with `S` the size in bytes as `distlab.theory.collective_bytes` counts it:
#
# | collective | rank r holds before | every rank holds after | each rank sends |
# |---|---|---|---|
# | `all_reduce` | a tensor of S bytes | the element-wise sum | 2(N-1)/N · S |
# | `reduce_scatter` | a tensor of S bytes, N chunks | chunk r of the sum (S/N) | (N-1)/N · S |
# | `all_gather` | a piece of S/N bytes | all N pieces in rank order (S) | (N-1)/N · S |
# | `all_to_all` | N chunks of S/N bytes | chunk r of every rank | (N-1)/N · S |
# | `broadcast` | the root's tensor (S) | the root's tensor | S, except the last of the chain |
#
# Where the ring numbers come from: in a ring, each rank passes one chunk of S/N to its neighbour per
# step. A reduce-scatter takes N-1 steps (each chunk travels round the ring, picking up every rank's
# share), an all-gather N-1 more (each finished chunk travels round again), so an all-reduce, which is
# the two one after the other, sends 2(N-1) chunks. The all-to-all is no ring: each rank sends chunk
# j straight to rank j, N-1 pairwise exchanges of S/N, nothing forwarded, which also comes to
# (N-1)/N · S. The theory's broadcast is a pipelined chain: the root sends S to the next rank, which
# forwards it, and so on (NCCL's ring broadcast).
#
# First, what each does, on tensors small enough to read. Rank r holds `[10r, 10r+1, 10r+2, 10r+3]`:

# %%
# %%ddp
torch.set_num_threads(1)                     # 4 ranks share 2 cores


def all_gather(piece, group=None):
    """All ranks' pieces side by side, in rank order."""
    whole = torch.empty(dist.get_world_size(group) * piece.numel(), device=device)
    dist.all_gather_single(whole, piece, group=group)
    return whole


x = torch.arange(4.0, device=device) + 10 * rank
seen = {"input": x}
total = x.clone()
dist.all_reduce(total)                       # every rank: the element-wise sum
seen["all_reduce"] = total
mine = torch.empty(1, device=device)
dist.reduce_scatter_single(mine, x)          # rank r: the sum of element r only
seen["reduce_scatter"] = mine
seen["all_gather"] = all_gather(mine)        # every rank: the reduce-scatter's pieces side by side
swapped = torch.empty(4, device=device)
dist.all_to_all_single(swapped, x)           # rank r: element r of every rank
seen["all_to_all"] = swapped
from_root = x.clone()
dist.broadcast(from_root, src=0)             # every rank: rank 0's tensor
seen["broadcast"] = from_root
seen = {op: [int(v) for v in t] for op, t in seen.items()}

# %% tags=["nbval-check-output"]
import torch

from distlab import theory

lab = distlab.current_lab()
seen = lab.pull("seen")
print(f"{'':>15}" + "".join(f"{'rank ' + str(r):>20}" for r in seen))
for op in seen[0]:
    print(f"{op:>15}" + "".join(f"{seen[r][op]!s:>20}" for r in seen))

# %% [markdown]
# Read it row by row. The all-gather gathered the reduce-scatter's pieces, and its row is the
# all-reduce's row: **all-reduce = reduce-scatter, then all-gather**. The all-to-all is a transpose:
# rank r ends with element r of every rank's input. (`reduce_scatter_single` and `all_gather_single` take
# one flat tensor each; they are torch 2.13's names for `reduce_scatter_tensor` and
# `all_gather_into_tensor`. `dist.reduce_scatter` and `dist.all_gather` take lists of chunks.)
#
# ## 1.1 Rebuilding all-reduce, bit for bit
#
# Is the rebuilt all-reduce the same to the last bit? Below, each rank takes 262,144 numbers (1 MiB of
# float32) and compares `dist.all_reduce` with other ways of getting the same sum: gloo's
# reduce-scatter (both forms: one tensor, and a list of chunks) then an all-gather; the sum added rank
# after rank, `((x0 + x1) + x2) + x3`; and a ring reduce-scatter written by hand with `isend`/`recv`
# (then an all-gather), with the chunks passed to the next rank or to the previous one. Once with
# integers (exact in float32 at these sizes), once with random floats; on the 4 ranks, and on 2 (ranks
# 0 and 1, a group of their own).

# %%
# %%ddp
M = 1 << 18                                  # 262,144 float32: 1 MiB per rank
pair = dist.new_group([0, 1])                # every rank calls new_group, even those left out
group_of = {2: pair, 4: None}                # None: all ranks


def members(group):
    return dist.get_process_group_ranks(group) if group is not None else list(range(world_size))


def reduce_scatter_all_gather(x, group=None, form="tensor"):
    n = len(members(group))
    piece = torch.empty(x.numel() // n, device=device)
    if form == "tensor":
        dist.reduce_scatter_single(piece, x, group=group)
    else:
        dist.reduce_scatter(piece, list(x.chunk(n)), group=group)
    return all_gather(piece, group)


def in_rank_order(x, group=None):
    every = all_gather(x, group).view(-1, x.numel())      # row k: rank k's x
    total = every[0].clone()
    for row in every[1:]:
        total += row
    return total


def ring_reduce_scatter(x, group=None, step=1):
    """A ring reduce-scatter by hand: N-1 steps; in each, every rank sends one chunk to its neighbour
    (the rank `step` places on) and adds the chunk it receives into its own copy. Chunk i starts at
    rank i + step, travels round the ring, and ends, summed, at rank i."""
    ranks = members(group)
    n, me = len(ranks), ranks.index(rank)
    chunks = [c.clone() for c in x.chunk(n)]
    to, frm = ranks[(me + step) % n], ranks[(me - step) % n]
    for k in range(1, n):
        out, into = (me - k * step) % n, (me - (k + 1) * step) % n
        incoming = torch.empty_like(chunks[into])
        sending = dist.isend(chunks[out], to, group=group)
        dist.recv(incoming, frm, group=group)
        sending.wait()
        chunks[into] += incoming
    return chunks[me]


def compare(kind, group):
    """{way: (elements that differ from dist.all_reduce, largest difference)}."""
    g = torch.Generator().manual_seed(rank)
    # made on the CPU by its generator, then moved
    x = (torch.randint(-1000, 1000, (M,), generator=g).to(device).float() if kind == "integers"
         else torch.randn(M, generator=g).to(device))
    reference = x.clone()
    dist.all_reduce(reference, group=group)
    ways = {
        "reduce_scatter_single, all_gather": reduce_scatter_all_gather(x, group),
        "reduce_scatter (list), all_gather": reduce_scatter_all_gather(x, group, form="list"),
        "added in rank order": in_rank_order(x, group),
        "ring by hand, to rank + 1": all_gather(ring_reduce_scatter(x, group, +1), group),
        "ring by hand, to rank - 1": all_gather(ring_reduce_scatter(x, group, -1), group),
    }
    return {way: (int((y != reference).sum()), (y - reference).abs().max().item()) for way, y in ways.items()}


differ = {}
for n, group in group_of.items():
    if rank in members(group):
        for kind in ("integers", "random floats"):
            differ[n, kind] = compare(kind, group)

# %%
differ = lab.pull("differ", 0)[0]
print(f"{'':>33}" + "".join(f"{f'{n} ranks, {kind}':>26}" for n, kind in differ))
for way in differ[4, "integers"]:
    print(f"{way:>33}" + "".join(f"{f'{c:,} differ (max {d:.0e})':>26}" if c else f"{'same bits':>26}"
                                 for c, d in (row[way] for row in differ.values())))

# %% [markdown]
# Float addition is commutative (`a + b == b + a`, exactly) but not associative: `(a + b) + c` and
# `a + (b + c)` can differ in the last bit. With integers every order gives the exact sum. With 2
# ranks each element is a single addition, so every way gives the same bits too. With 4 ranks the
# order decides the last bits, and the table shows whose order gloo's all-reduce follows:
#
# * **not rank order**: about a third of the elements differ from `((x0 + x1) + x2) + x3`, by a unit
#   or two in the last place;
# * **the hand-written ring matches it when it passes chunks towards the previous rank**: gloo's
#   ring all-reduce adds chunk i starting at rank i - 1 and going down the ranks to i. Passed the
#   other way, the same ring with the same bytes gives the same sum in another order, and other
#   last bits;
# * **gloo's two reduce-scatters disagree with each other.** The one-tensor form gives the
#   all-reduce's bits for a plain reason: on gloo it *is* an all-reduce of the whole tensor that keeps
#   chunk r (`ProcessGroupGloo.cpp`). The list form all-reduces each chunk on its own (checked on
#   these ranks while writing this lab: its result equals `dist.all_reduce` of chunk r alone, bit for
#   bit), and a ring over a quarter of the data adds in another order. Both move an all-reduce's bytes,
#   as the counters below show.
#
# So the order of a reduction is part of its result. Runs repeat bit for bit only with the same
# algorithm, world size and rank order; NCCL picks ring or tree by message size and topology
# (`NCCL_ALGO` pins it), which is one reason GPU runs at different scales differ in the last bits.

# %% tags=["nbval-check-output"]
ints = [c for (n, kind), row in differ.items() if kind == "integers" for c, _ in row.values()]
floats2, floats4 = differ[2, "random floats"], differ[4, "random floats"]
print("integers, 2 and 4 ranks: every way gives all_reduce's bits:", all(c == 0 for c in ints))
print("random floats, 2 ranks: every way gives all_reduce's bits:", all(c == 0 for c, _ in floats2.values()))
print("random floats, 4 ranks, all_reduce's bits from:",
      [way for way, (c, _) in floats4.items() if c == 0])
print("random floats, 4 ranks, other bits from:", [way for way, (c, _) in floats4.items() if c > 0])

# %% [markdown]
# ## 1.2 Bytes on the links
#
# Theory first: `theory.collective_bytes(op, S, N, rank)` gives the bytes one rank sends and receives
# in one collective, on the ring (and chain) NCCL uses, and in the all-to-all's pairwise exchanges.
# For S = 4 MiB on 4 ranks:

# %% tags=["nbval-check-output"]
MiB = 1 << 20
S = 4 * MiB
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
print(f"{'S = 4 MiB, N = 4':>16}   MiB sent / received by rank 0, 1, 2, 3")
for op in OPS:
    print(f"{op:>16}   " + "   ".join(f"{b.sent_bytes / MiB:.2f} / {b.received_bytes / MiB:.2f}"
                                     for b in (theory.collective_bytes(op, S, 4, rank=r) for r in range(4))))

# %% [markdown]
# **Predict.** Rank 2 joins a reduce-scatter of a 4 MiB tensor with the 3 other ranks. How many bytes
# will its node receive? (The widget grades your guess against the theory.)

# %%
from distlab.quiz import predict


def received_bytes(op, size_bytes, world_size, rank):
    """What theory says `rank` receives in one `op`."""
    return theory.collective_bytes(op, size_bytes, world_size, rank=rank).received_bytes


guess = predict("How many bytes will rank 2 receive in a reduce_scatter of a 4 MiB tensor over 4 ranks?",
                theory=received_bytes, unit="MiB", tolerance=0.1,
                op="reduce_scatter", size_bytes=S, world_size=4, rank=2)
guess

# %% [markdown]
# **Then measure.** Each case runs between two barriers, on 4 MiB as the theory counts S (the
# all-reduce's tensor, the reduce-scatter's whole input, the all-gather's whole output, what each rank
# holds for the all-to-all, the broadcast's tensor), on all 4 ranks and on the pair (ranks 0 and 1),
# three times; the table keeps each rank's median (a stray packet now and then does not move it).
# Two counters: `lab.link_bytes()` (in the notebook, before and after) reads what each node's link
# queue sent, and each rank reads its own network interface's received bytes
# (`/proc/net/dev`, the kernel's counter inside the node). The hand-written ring reduce-scatter runs
# too, next to gloo's.

# %%
# %%ddp
S = 4 << 20


def interface_bytes():
    """(received, sent) bytes this node's network interface has counted so far."""
    with open("/proc/net/dev") as counters_file:
        for line in counters_file:
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                fields = counters.split()
                return int(fields[0]), int(fields[8])
    raise RuntimeError("no eth0 here: this rank is not on an emulated node")


def run(op, group=None):
    """`op` once on S bytes, with S as distlab.theory counts it for that op."""
    n = len(members(group))
    x = torch.ones(S // 4, device=device)                                   # S bytes of float32
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_single(torch.empty(x.numel() // n, device=device), x, group=group)   # S: the whole input
    elif op == "reduce_scatter, ring by hand":
        ring_reduce_scatter(x, group)
    elif op == "all_gather":
        all_gather(torch.ones(x.numel() // n, device=device), group)       # S: the whole output
    elif op == "all_to_all":
        dist.all_to_all_single(torch.empty_like(x), x, group=group)
    elif op == "broadcast":
        dist.broadcast(x, src=members(group)[0], group=group)


def received_by_me(op, group=None):
    dist.barrier()
    before = interface_bytes()[0]
    if rank in members(group):
        run(op, group)
    dist.barrier()                           # every byte of the op has arrived everywhere
    return interface_bytes()[0] - before

# %%
CASES = [(op, n) for op in ("all_reduce", "reduce_scatter", "reduce_scatter, ring by hand", "all_gather",
                            "all_to_all", "broadcast") for n in (4, 2)]
REPEATS = 3
sent, received = {}, {}                      # the median of the repeats, per rank
if on_nodes:
    for op, n in CASES:
        runs = []
        for _ in range(REPEATS):
            before = lab.link_bytes()
            got = lab.run(f"received_by_me({op!r}, group_of[{n}])", stream=False)
            after = lab.link_bytes()
            runs.append(({r: after[r] - before[r] for r in after}, got))     # node r holds rank r
        sent[op, n] = {r: sorted(s[r] for s, _ in runs)[REPEATS // 2] for r in range(4)}
        received[op, n] = {r: sorted(g[r] for _, g in runs)[REPEATS // 2] for r in range(4)}


def expected(op, n, r):
    """Theory's (sent, received) for rank r; (0, 0) for a rank outside the first n."""
    b = theory.collective_bytes(op.split(",")[0], S, n, rank=r) if r < n else None
    return (b.sent_bytes, b.received_bytes) if b else (0.0, 0.0)


def ratios(op, n, which):
    """measured / theory for each rank the theory gives bytes to; which: "sent" or "received"."""
    got, i = (sent, 0) if which == "sent" else (received, 1)
    return [got[op, n][r] / expected(op, n, r)[i] for r in range(n) if expected(op, n, r)[i] > 0]


RING = ("all_reduce", "reduce_scatter, ring by hand", "all_gather", "all_to_all")


if on_nodes:
    print("MiB per rank: measured (theory); sent is the link's count, received the rank's interface's\n")
    print(f"{'':>28} {'N':>2} {'':>9}" + "".join(f"{'rank ' + str(r):>17}" for r in range(4)))
    for op, n in CASES:
        cols = [(sent[op, n][r], received[op, n][r], *expected(op, n, r)) for r in range(4)]
        print(f"{op:>28} {n:>2} {'sent':>9}" + "".join(f"{s / MiB:>8.2f} ({es / MiB:.2f})" for s, _, es, _ in cols))
        print(f"{'':>31} {'received':>9}" + "".join(f"{g / MiB:>8.2f} ({eg / MiB:.2f})" for _, g, _, eg in cols))
    on_links = [q for op in RING for n in (2, 4) for q in ratios(op, n, "sent")]
    at_ranks = [q for op in RING for n in (2, 4) for q in ratios(op, n, "received")]
    gloo_rs = [received["reduce_scatter", n][r] / theory.collective_bytes("all_reduce", S, n).received_bytes
               for n in (2, 4) for r in range(n)]
    print(f"\nring ops, measured / theory: the links sent {min(on_links):.4f} to {max(on_links):.4f}, "
          f"the interfaces received {min(at_ranks):.4f} to {max(at_ranks):.4f}; gloo's reduce_scatter received "
          f"{min(gloo_rs):.4f} to {max(gloo_rs):.4f} x an all-reduce's bytes")
else:
    saved("bytes per collective")

# %% [markdown]
# Your prediction, the theory, and what rank 2's interface counted:

# %%
guess.reveal(received["reduce_scatter", 4][2]) if on_nodes else "no link here: nothing to compare"

# %% [markdown]
# What the counters say, op by op:
#
# * **all-reduce, all-gather, all-to-all and the ring by hand** move what the theory says (the rings'
#   bytes, and the all-to-all's pairwise (N-1)/N · S: the "ring ops" of the checks), on every rank, at
#   4 and at 2 ranks (ranks 2 and 3 stay idle in the pair's rows).
# * **gloo's reduce-scatter moves twice the theory**: exactly an all-reduce's bytes, 2(N-1)/N · S
#   instead of (N-1)/N · S, because it is one (above; the list form too, being N all-reduces of S/N).
#   The reduce-scatter written by hand with `isend`/`recv` moves the ring's (N-1)/N · S. NCCL's
#   reduce-scatter is the ring, which is why ZeRO and FSDP, built on reduce-scatter, cost what the
#   theory says on GPUs, and more on gloo.
# * **broadcast**: every rank but the root receives S, as in the chain, but the root sends 2 S and
#   rank 1 one S, while ranks 2 and 3 forward nothing. gloo's broadcast is a tree (the root sends to
#   two ranks, one of which passes it on), not the pipelined chain of the theory: the same bytes in
#   all, spread differently, and log2(N) rounds instead of N-1 hops.
#
# And the few percent on top. Each link's queue counts every frame as a 1,500-byte-MTU wire would
# carry it: 1,448 bytes of data in 1,514 bytes of frame (Ethernet, IP and TCP headers, TCP
# timestamps), 4.6% more, plus the receiver's acknowledgements: **4.8%** above the theory here. The
# interface counts the packets as the kernel hands them from one end of the virtual link to the other:
# up to 64 KiB each (segmentation offload), with one set of headers each, so received bytes are only
# **0.2-0.3%** above. Barriers and the lab's own messages add a few KiB per case (the idle ranks' rows).
# The checks below allow the interfaces up to 5% over the theory, not 1%: what a receiver counts is
# whatever arrives, and on a loaded machine more arrives now and then (one run of this notebook beside
# a test suite saw a broadcast's receiver over 1%; one way that happens: TCP sends a segment again
# when its acknowledgement is late, and the receiver counts both copies).

# %% tags=["nbval-check-output"]
if on_nodes:
    print("ring ops, 2 and 4 ranks: links sent 1.03x to 1.07x theory:",
          all(1.03 < q < 1.07 for op in RING for n in (2, 4) for q in ratios(op, n, "sent")))
    print("ring ops, 2 and 4 ranks: interfaces received 1.00x to 1.05x theory:",
          all(1.0 < q < 1.05 for op in RING for n in (2, 4) for q in ratios(op, n, "received")))
    all_reduce_bytes = {n: theory.collective_bytes("all_reduce", S, n).received_bytes for n in (2, 4)}
    print("gloo's reduce_scatter receives an all-reduce's bytes (1.00x to 1.05x), 2x the ring's:",
          all(1.0 < received["reduce_scatter", n][r] / all_reduce_bytes[n] < 1.05 for n in (2, 4) for r in range(n)))
    print("broadcast: every other rank received S (1.00x to 1.05x):",
          all(1.0 < q < 1.05 for n in (2, 4) for q in ratios("broadcast", n, "received")))
    print("broadcast, 4 ranks: the links carried (N-1) S in all (1.03x to 1.07x):",
          1.03 < sum(sent["broadcast", 4].values()) / (3 * S) < 1.07)
    print("broadcast, 4 ranks: the root sent 2 S, a tree (1.9x to 2.2x S):", 1.9 < sent["broadcast", 4][0] / S < 2.2)
else:
    saved("bytes per collective: checks")

# %% [markdown]
# ## Practice
#
# The live questions run on your 4 ranks.

# %%
# %quiz communication-cost -n 3

# %% [markdown]
# ## Build it yourself
#
# The exercise nearest this lesson is notebook 03's (notebook [17](17-exercises.ipynb) introduces the
# exercises; each is graded on ranks the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise ring-allreduce`: the ring of section 1.1 in both of its phases, a reduce-scatter then an all-gather, from `send` and `recv` only, its bytes counted against the ring model.
#
# ## Next
#
# Notebook [14b](14b-dtensor-tensor-parallel.ipynb) builds on these collectives: each change of a
# `DTensor`'s layout is one of them, and tensor and sequence parallelism are all-reduces,
# reduce-scatters and all-gathers of activations inside every layer, their bytes counted with the ring
# formula measured here.

# %%
# %dist stop
