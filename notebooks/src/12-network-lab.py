# %% [markdown]
# # 12 · A network lab: nodes, links and the ring model
#
# In the other labs every rank runs on this one machine and reaches the others through loopback: the
# "network" there is memory copies, and the bandwidth notebook 03 fitted is the CPU's. Here distlab
# builds a small cluster inside the machine. Each **node** is a Linux network namespace with its own
# address and host name, joined to a switch by one link that the kernel shapes to a set rate in both
# directions (`tc`'s token bucket filter, `tbf`). Ranks on the same node talk through that node's own
# loopback; ranks on different nodes go over the links. Every node has its own link to one switch (a
# star), which is what the ring model assumes:
#
# $$T \approx \frac{2(N-1)}{N}\cdot\frac{S}{B} + 2(N-1)\,a$$
#
# for a ring all-reduce of `S` bytes over `N` workers, links of bandwidth `B`, and a latency `a` per
# ring step: a reduce-scatter then an all-gather, N-1 steps each (Thakur, Rabenseifner and Gropp
# 2005). This kernel has no `netem`, so no delay is added to the links: they impose a rate only.
#
# In this lab: the same all-reduce between two ranks on one node and on two nodes, with the bytes that
# crossed the links; a hierarchical all-reduce built from subgroups against the flat ring; then the
# ring model predicted, measured and fitted on 2, 3 and 4 nodes, at 100 Mbit/s, 1 Gbit/s and with no
# shaping at all.
#
# Making namespaces and links takes root's CAP_NET_ADMIN or, for a user without it, a user namespace
# of the lab's own, which most Linux machines allow. Where neither can be had (some containers, on
# Binder perhaps), the cell below says so and starts the same four ranks on loopback: everything below
# still runs, but the times then measure the CPU copying bytes, not a link; so each cell whose result
# needs the links also shows what it printed in the run on nodes this notebook was saved from, every
# line marked `saved |`.

# %%
# %load_ext distlab
import distlab
from distlab.cluster.nodes import nodes_here
from distlab.notebook.saved import saved_from_nodes

# True where emulated nodes can be made; elsewhere False, after one line saying why not
on_nodes = nodes_here("4 ranks on loopback instead, so the times below are CPU copying, not a link")
saved = saved_from_nodes("12-network-lab")   # without nodes: what the cells printed on them, marked saved
nodes = "--nodes 2 --link 100mbit" if on_nodes else ""

# %% [markdown]
# IPython fills `{nodes}` in before the magic runs: with nodes the line reads
# `%dist start -n 4 --nodes 2 --link 100mbit`, without them `%dist start -n 4`.

# %%
# %dist start -n 4 {nodes}

# %% [markdown]
# `%dist status` shows where each rank runs: its node (host name), the node's address, and under the
# table the link.

# %%
# %dist status

# %% [markdown]
# Ranks are numbered node by node: ranks 0 and 1 on `node0`, ranks 2 and 3 on `node1`, and
# `local_rank` counts within a node. The link is 100 Mbit/s each way: `B` = 12.5 MB/s (1 MB = 10^6
# bytes here; buffer sizes below are in MiB, 2^20 bytes).
#
# Two helpers. In the notebook, `link_bytes()` reads how many bytes each node has sent onto its link
# so far, from the kernel's counters on the link's queue. For the ranks, `timed(op, size, device)` runs an
# operation on a buffer once to warm up and three times timed, each run after a barrier, and keeps the
# median of the slowest rank (a collective ends at about the same moment everywhere, but a rank can
# start early and wait). It is defined here and pushed to the ranks.

# %%
import torch
from distlab import theory

lab = distlab.current_lab()
MB = 1 << 20                 # buffer sizes: MiB
RUNS = 4                     # timed() runs each operation 4 times: 1 warm-up, 3 timed


def link_bytes():
    """{node: bytes it has sent onto its link so far} ({} when the ranks are not on nodes)."""
    return lab.link_bytes() if on_nodes else {}


def sent_per_run(before, after):
    """Bytes each node sent onto its link per run of the operation measured in between."""
    return {node: (after[node] - before[node]) / RUNS for node in after}


def timed(op, size_bytes, device, members=None):
    """Median seconds of op(buf) on a float32 buffer of size_bytes, on the slowest rank of `members`.

    Every rank calls it (the barriers and the final MAX involve them all); ranks outside `members`
    (default: all) skip the operation. `device` is the rank's (a pushed function does not see the
    rank's names, so the cell passes it).
    """
    import time
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.ones(size_bytes // 4, device=device)
    runs = []
    for i in range(RUNS):
        dist.barrier()
        t0 = time.perf_counter()
        if members is None or rank in members:
            op(buf)
            if device.type == "cuda":
                torch.cuda.synchronize(device)       # CUDA runs asynchronously: time the op, not its launch
        runs.append(time.perf_counter() - t0)
    t = torch.tensor(sorted(runs[1:])[(RUNS - 1) // 2], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


lab.push(timed=timed, RUNS=RUNS, MB=MB)
rate = lab.link.bytes_per_s if on_nodes else None
print(f"link: {lab.link or 'none (loopback)'}" + (f", B = {rate / 1e6:g} MB/s each way" if on_nodes else ""))

# %% [markdown]
# ## Same node or not
#
# The same 16 MiB all-reduce, first between two ranks on one node (0 and 1), then between two ranks on
# different nodes (0 and 2). `dist.new_group` makes a group of some ranks (every rank must call it, in
# the same order, even those left out). With N = 2 the ring model says each rank sends
# `2(N-1)/N * S = S` bytes, so the pair across the link needs `S/B` = 16.8 MB / 12.5 MB/s = 1.34 s;
# the pair on one node never touches a link.

# %%
# %%ddp
same_node = dist.new_group([0, 1])
two_nodes = dist.new_group([0, 2])
dist.barrier()

# %%
before = link_bytes()

# %%
# %%ddp
t_same = timed(lambda b: dist.all_reduce(b, group=same_node), 16 * MB, device, members=(0, 1))

# %%
middle = link_bytes()

# %%
# %%ddp
t_cross = timed(lambda b: dist.all_reduce(b, group=two_nodes), 16 * MB, device, members=(0, 2))

# %%
after = link_bytes()
t_same, t_cross = lab.pull("t_same", 0)[0], lab.pull("t_cross", 0)[0]
S = 16 * MB
sent_same, sent_cross = (sent_per_run(before, middle), sent_per_run(middle, after)) if on_nodes else ({}, {})


def mib(sent):
    return ", ".join(f"node{n} {b / MB:.2f}" for n, b in sent.items()) or "(no link)"


print(f"{'16 MiB all-reduce':<24} {'time':>8} {'ring model S/B':>15}   MiB sent onto the links per all-reduce")
print(f"{'ranks 0, 1 (one node)':<24} {t_same:>7.3f}s {'no link':>15}   {mib(sent_same)}")
model = f"{theory.ring_allreduce_time_s(S, 2, rate):.3f}s" if on_nodes else "no link"
print(f"{'ranks 0, 2 (two nodes)':<24} {t_cross:>7.3f}s {model:>15}   {mib(sent_cross)}")
print(f"\nthe pair on one node was {t_cross / t_same:.0f}x faster" if on_nodes else
      "\nno nodes here: both pairs are on this one machine")
if not on_nodes:
    saved("one node, two nodes")

# %% [markdown]
# What the counters say, checked with generous margins. The pair on one node puts next to nothing
# onto the links (only the ranks' small messages to the controller, which sits on the switch). The
# pair across the link sends one `S` per node, and a little more: a packet of 1,500 bytes (the links'
# MTU) less 20 bytes of IP header, 20 of TCP header and 12 of TCP timestamps carries 1,448 bytes of
# data, and `tbf` also counts the 14-byte Ethernet header, so a full frame puts 1,514 bytes on the link
# for 1,448 of data: at least 1514/1448 = 1.046 S.

# %% tags=["nbval-check-output"]
if on_nodes:
    print("one node: under 1% of S went onto the links:", all(b < 0.01 * S for b in sent_same.values()))
    print("two nodes: each node sent between S and 1.15 S:", all(S < b < 1.15 * S for b in sent_cross.values()))
else:
    saved("one node, two nodes: checks")
print("the pair on one node is faster:", t_same < t_cross)

# %%
if on_nodes:
    frames = [b / S for b in sent_cross.values()]
    print(f"bytes on the link per byte of data: {min(frames):.3f} to {max(frames):.3f} "
          f"(full frames alone: {1514 / 1448:.3f})")
    print(f"ring model with the nominal B: {theory.ring_allreduce_time_s(S, 2, rate):.3f} s; "
          f"measured {t_cross:.3f} s, {t_cross / theory.ring_allreduce_time_s(S, 2, rate) - 1:+.0%}")

# %% [markdown]
# The measured time is above `S/B`, for the first reason the counters show: the link carries headers
# too. More on the rest below, where the model is fitted.
#
# ## A hierarchical all-reduce
#
# A flat ring over the 4 ranks goes 0 → 1 → 2 → 3 → 0. Two of its four hops stay on a node (0 → 1,
# 2 → 3); two cross the links (1 → 2 leaves node0, 3 → 0 leaves node1). Every hop of a ring carries
# what each rank sends, `2(N-1)/N * S` = 1.5 S for N = 4, so each node sends 1.5 S onto its link, and
# the ring takes about `1.5 S/B`: a ring goes at the pace of its slowest hop.
#
# A **hierarchical** all-reduce uses the links less:
#
# 1. reduce within each node onto its leader (its first rank): loopback only;
# 2. all-reduce between the M = 2 leaders: each sends `2(M-1)/M * S` = S over its link;
# 3. each leader broadcasts the total within its node: loopback again.
#
# So each node sends S onto its link instead of 1.5 S (2/3 of the bytes), and the time is about
# `S/B` plus the two local steps. In general, with k ranks on each of M nodes, numbered node by node,
# the flat ring sends `2(kM-1)/(kM) * S` onto each node's link (towards 2 S as kM grows), the
# hierarchical one `2(M-1)/M * S`: `k(M-1)/(kM-1)` of the flat ring's bytes. The saving is largest
# with two nodes (a third here; less than half however many ranks share a node) and shrinks as the
# nodes grow in number: 8 nodes of 8 ranks send 0.89 of the flat ring's bytes, and the ratio tends
# to 1. What stays is the shorter ring over the links: `2(M-1)` steps that pay their latency there,
# not `2(kM-1)`.
#
# First, is it right? Sums of integers are exact in float32 (here far below 2^24), so the two must
# agree bit for bit:

# %%
# %%ddp
per_node = 2
node_groups = [dist.new_group([n * per_node + i for i in range(per_node)]) for n in range(world_size // per_node)]
my_node = node_groups[rank // per_node]
leader = rank // per_node * per_node                        # the first rank of my node
leaders = dist.new_group(list(range(0, world_size, per_node)))


def hierarchical_all_reduce(buf):
    dist.reduce(buf, dst=leader, group=my_node)              # 1. sum within the node onto its leader
    if rank == leader:
        dist.all_reduce(buf, group=leaders)                  # 2. ring all-reduce between the leaders
    dist.broadcast(buf, src=leader, group=my_node)           # 3. the leader hands the total to its node


x = torch.randint(0, 1000, (4 * MB // 4,), generator=torch.Generator().manual_seed(rank)).to(device).float()
flat, hier = x.clone(), x.clone()
dist.all_reduce(flat)
hierarchical_all_reduce(hier)
same = torch.equal(flat, hier)

xf = torch.randn(4 * MB // 4, generator=torch.Generator().manual_seed(rank)).to(device)
flat_f, hier_f = xf.clone(), xf.clone()
dist.all_reduce(flat_f)
hierarchical_all_reduce(hier_f)
float_diff = ((flat_f != hier_f).sum().item(), (flat_f - hier_f).abs().max().item())

# Steps 1 and 3 alone, timed: they stay on the nodes (the ring model has no term for them).
t_local = timed(lambda b: (dist.reduce(b, dst=leader, group=my_node), dist.broadcast(b, src=leader, group=my_node)),
                16 * MB, device)

# %% tags=["nbval-check-output"]
print("hierarchical == dist.all_reduce, bit for bit, integer sums on every rank:", all(lab.pull("same").values()))

# %% [markdown]
# With arbitrary floats, the two add the same four numbers in a different order, and float addition
# is not associative:

# %%
n_diff, max_diff = lab.pull("float_diff", 0)[0]
print(f"random floats: {n_diff:,} of {4 * MB // 4:,} sums differ, by at most {max_diff:.1e}")

# %% [markdown]
# Now time both on 16 MiB, with the counters read around each:

# %%
before = link_bytes()

# %%
# %%ddp
t_flat = timed(dist.all_reduce, 16 * MB, device)

# %%
middle = link_bytes()

# %%
# %%ddp
t_hier = timed(hierarchical_all_reduce, 16 * MB, device)

# %%
after = link_bytes()
t_flat, t_hier = lab.pull("t_flat", 0)[0], lab.pull("t_hier", 0)[0]
sent_flat, sent_hier = (sent_per_run(before, middle), sent_per_run(middle, after)) if on_nodes else ({}, {})
t_local = lab.pull("t_local", 0)[0]
rows = [("flat ring, 4 ranks", t_flat, 4, 0.0, sent_flat), ("hierarchical, 2 leaders", t_hier, 2, t_local, sent_hier)]
print(f"{'16 MiB all-reduce':<24} {'time':>8} {'model':>8} {'MiB per node, model':>20}   measured")
for name, t, ring, local, sent in rows:
    model_t = f"{theory.ring_allreduce_time_s(S, ring, rate) + local:.3f}s" if on_nodes else "-"
    model_b = theory.ring_allreduce_sent_bytes(S, ring) / MB
    print(f"{name:<24} {t:>7.3f}s {model_t:>8} {model_b:>20.2f}   {mib(sent)}")
print(f"\nthe local steps (reduce and broadcast within the nodes) alone: {t_local:.3f} s")
if on_nodes:
    print(f"hierarchical / flat: time {t_hier / t_flat:.2f} (model {(theory.ring_allreduce_time_s(S, 2, rate) + t_local) / theory.ring_allreduce_time_s(S, 4, rate):.2f}), "
          f"bytes on the links {sum(sent_hier.values()) / sum(sent_flat.values()):.2f} (model {2 / 3:.2f})")
else:
    saved("hierarchical")

# %% [markdown]
# The model columns are `2(N-1)/N * S/B` and `2(N-1)/N * S` with N = 4 for the flat ring (each node's
# link carries one hop of it) and N = 2 for the leaders' ring, plus, for the hierarchical one, the
# local steps as measured. The bytes follow the model, times the header share seen above, and the
# hierarchical all-reduce sends two thirds of the flat ring's bytes. Both times are above their model
# by about the same share (the headers again, and more, looked at below), so the ratio of the times is
# close to the model's, which is above 2/3 because the local steps are added.

# %% tags=["nbval-check-output"]
if on_nodes:
    ratio = sum(sent_hier.values()) / sum(sent_flat.values())
    print("hierarchical: 0.6 to 0.75 of the flat ring's bytes on the links (model 2/3):", 0.6 < ratio < 0.75)
    print("hierarchical took less time:", t_hier < t_flat)
else:
    saved("hierarchical: checks")

# %% [markdown]
# ## The ring model, one rank per node
#
# To vary N with one rank on each node, start again on 4 nodes; rings over the first 2, 3 and 4
# ranks are rings over 2, 3 and 4 nodes. (`%dist restart -n N` keeps the nodes it has, so a
# different number of nodes means a new lab.)

# %%
# %dist stop

# %%
nodes = "--nodes 4 --link 100mbit" if on_nodes else ""
# %dist start -n 4 {nodes}
lab = distlab.current_lab()
lab.push(timed=timed, RUNS=RUNS, MB=MB)

# %%
# %dist status

# %% [markdown]
# **Predict first**, by the ring model without its latency term (`a` is not known yet: the fit below
# measures it). The table after the measurement puts the model beside every size and ring.

# %%
from distlab.quiz import predict

guess = predict("An all-reduce of 16 MiB over a ring of 4 nodes, each on its own 100 Mbit/s link (12.5 MB/s "
                "each way): how many seconds, by the ring model without its latency term?",
                theory="ring_allreduce_time_s", unit="s", tolerance=0.15,
                size_bytes=16 * MB, workers=4, bandwidth_bytes_per_s=100e6 / 8)
guess

# %% [markdown]
# **Then measure**, on rings of 2, 3 and 4 nodes:

# %%
# %%ddp
rings = {n: dist.new_group(list(range(n))) for n in (2, 3, 4)}


def ring_times(sizes=(1 * MB, 4 * MB, 16 * MB)):
    """(N, size, seconds) of an all-reduce on the ring of the first N ranks, for each N and size."""
    return [(n, size, timed(lambda b: dist.all_reduce(b, group=g), size, device, members=range(n)))
            for n, g in rings.items() for size in sizes]


dist.barrier()

# %%
before = link_bytes()

# %%
# %%ddp
at_100mbit = ring_times()

# %%
after = link_bytes()
at_100mbit = lab.pull("at_100mbit", 0)[0]
fit = theory.fit_latency_bandwidth(at_100mbit)


def table(measured, fit, rate):
    print(f"{'N':>3} {'size':>7} {'measured':>9} {'model, set B':>13} {'model, fitted':>14}")
    for n, size, t in measured:
        nominal = f"{theory.ring_allreduce_time_s(size, n, rate):.3f}s" if rate else "-"
        print(f"{n:>3} {size // MB:>3} MiB {t:>8.3f}s {nominal:>13} {fit.allreduce_time_s(size, n):>13.3f}s")
    print(f"\nfitted: a = {fit.latency_s * 1e3:.2f} ms, B = {fit.bandwidth_bytes_per_s / 1e6:.2f} MB/s"
          + (f", {fit.bandwidth_bytes_per_s / rate:.0%} of the link's {rate / 1e6:g} MB/s" if rate else ""))


table(at_100mbit, fit, rate)
fit_100mbit = fit
if not on_nodes:
    saved("rings at 100mbit")

# %% [markdown]
# Time grows with `2(N-1)/N` (1, 1.33, 1.5 for N = 2, 3, 4) and with S, as the model says, and the
# fit over all nine points recovers a bandwidth a little below the link's rate. Why below, from the
# link's own counters: node k takes part in the rings of more than k nodes, and in each it sends
# `2(N-1)/N * S` per run; the counters show how many bytes that took on its link.

# %%
if on_nodes:
    sent = sent_per_run(before, after)
    data = {k: sum(theory.ring_allreduce_sent_bytes(size, n) for n, size, _ in at_100mbit if n > k) for k in sent}
    print(f"{'node':>5} {'data sent per run, model':>25} {'bytes on its link':>18} {'ratio':>6}")
    for k in sent:
        print(f"{k:>5} {data[k] / MB:>21.2f} MiB {sent[k] / MB:>14.2f} MiB {sent[k] / data[k]:>6.3f}")
    share = sum(data.values()) / sum(sent.values())
    print(f"\ndata share of the link's bytes: {share:.1%}; so at most {share * rate / 1e6:.2f} MB/s of data "
          f"fit in {rate / 1e6:g} MB/s; fitted B = {fit.bandwidth_bytes_per_s / 1e6:.2f} MB/s "
          f"({fit.bandwidth_bytes_per_s / (share * rate):.0%} of that)")
else:
    saved("bytes per node")

# %% tags=["nbval-check-output"]
if on_nodes:
    print("every node's link bytes are its ring data times 1.0 to 1.15:",
          all(1.0 < sent[k] / data[k] < 1.15 for k in sent))
    print("fitted B at 100mbit is 80% to 100% of the set rate:", 0.8 < fit.bandwidth_bytes_per_s / rate < 1.0)
else:
    saved("bytes per node: checks")

# %% [markdown]
# So the fitted B sits below the set rate mostly because of the headers: `tbf` meters whole frames,
# and a few percent of each is Ethernet, IP and TCP headers, not data (the ratio column; above
# 1514/1448 because not every frame is full). Counting them, the fitted B is close to all the data the
# link can carry (the last line).
#
# The `a` of the fit is not a wire delay (none was added), and these measurements can hardly see it:
# even the smallest all-reduce here spends tens of milliseconds on the link, so noise of a few percent
# on the large ones moves the fitted `a` by milliseconds either way (a negative fit is clamped to 0).
# It is whatever does not grow with S, per ring step: software, and data waiting in the link's queue.
# To measure a latency, time small messages, as notebook 03 does down to 4 KB.
#
# ## Ten times faster: 1gbit, and no shaping at all
#
# `lab.set_link("1gbit")` (or `%dist link 1gbit`) reshapes every link between cells. The model says
# everything should take a tenth of the time. On this 2-core machine the bytes are copied by the CPU
# (into the sockets, through the veth pairs, out again), so at some rate the CPU, not the link, sets
# the pace. To see where, the last run takes the shaping off (`lab.set_link(None)`): what is left is
# the machine's own limit.

# %%
if on_nodes:
    lab.set_link("1gbit")
    print("link:", lab.link)

# %%
# %%ddp
at_1gbit = ring_times()

# %%
at_1gbit = lab.pull("at_1gbit", 0)[0]
fit_1gbit = theory.fit_latency_bandwidth(at_1gbit)
table(at_1gbit, fit_1gbit, lab.link.bytes_per_s if on_nodes else None)
if on_nodes:
    lab.set_link(None)
    print("\nlink:", lab.link or "not shaped")
else:
    saved("rings at 1gbit")

# %%
# %%ddp
unshaped = ring_times(sizes=(4 * MB, 16 * MB))

# %%
unshaped = lab.pull("unshaped", 0)[0]
fit_unshaped = theory.fit_latency_bandwidth(unshaped)
print(f"{'link':>12} {'fitted B':>12} {'fitted a':>9}")
if not on_nodes:
    print("no links here: all three runs were on loopback")
for name, f in (("100mbit", fit_100mbit), ("1gbit", fit_1gbit), ("not shaped", fit_unshaped)):
    print(f"{name:>12} {f.bandwidth_bytes_per_s / 1e6:>7.1f} MB/s {f.latency_s * 1e3:>6.2f} ms")
print(f"\n1gbit / 100mbit: {fit_1gbit.bandwidth_bytes_per_s / fit_100mbit.bandwidth_bytes_per_s:.1f}x; "
      f"not shaped / 1gbit: {fit_unshaped.bandwidth_bytes_per_s / fit_1gbit.bandwidth_bytes_per_s:.1f}x")
if not on_nodes:
    saved("three links")

# %% [markdown]
# At 1gbit the fitted B is about the same share of the set rate as at 100mbit: the link, not the CPU,
# still sets the pace, and ten times the rate gives about ten times the bandwidth. With no shaping,
# the four ranks copy every byte through the kernel's network stack on two cores, and that limit (it
# moves with whatever else the machine is doing) is only a few times 1gbit (the last line): on this
# machine a link a few times faster than 1gbit would be CPU-bound, and the numbers would measure the
# machine, not the network, as on loopback in notebook 03.
#
# ## Build it yourself
#
# The exercise nearest this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on
# ranks the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise ring-allreduce`: the ring this lab timed over its links, from `send` and `recv` only, a
#   reduce-scatter then an all-gather; the grader counts each rank's bytes against the `2(N-1)/N` of
#   the model fitted above.
#
# ## Practice

# %%
# %quiz communication-cost -n 3 --seed 1

# %%
# %dist stop
