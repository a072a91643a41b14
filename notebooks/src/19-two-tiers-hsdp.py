# %% [markdown]
# # 19 · Two tiers: racks, uplinks and HSDP
#
# Notebook 12 joined every node to one switch by identical links: a star, which is what the ring model
# assumes. A real cluster has tiers. The nodes of a rack share a switch, and the racks reach each
# other through switches above them, by links that carry the traffic of a whole rack. Here distlab
# builds the smallest such cluster:
#
# - 4 nodes in 2 racks (`--racks 2`), one rank per node;
# - each node's link to its rack's switch at 1 Gbit/s (`--link`);
# - each rack's one **uplink** to the spine at 100 Mbit/s (`--uplink`), ten times slower.
#
# Every rack is a network namespace holding a bridge, and the kernel shapes both ends of every link
# and uplink (`tc`'s token bucket filter, as in notebook 12).
#
# Two questions make up the lab:
#
# 1. **Which edge of a ring is the slowest?** A ring all-reduce moves `2(N-1)/N * S` over every edge
#    at once, so it runs at the pace of its slowest edge (Thakur, Rabenseifner and Gropp 2005). Here
#    that is an uplink whenever the ring leaves a rack.
# 2. **Where should each collective run?** FSDP2 on a 2-D mesh shards inside one mesh dimension and
#    replicates across the other (HSDP, PyTorch's `fully_shard` on a `DeviceMesh` of two dimensions).
#    We train the same model sharded flat over all 4 ranks, sharded inside each rack with the racks
#    as replicas, and the mesh the wrong way round. The bytes on the uplinks are counted, and the
#    steps timed.
#
# Making namespaces and links takes root's CAP_NET_ADMIN or, for a user without it, a user namespace
# of the lab's own, which most Linux machines allow. Where neither can be had (some containers, on
# Binder perhaps), the cell below says so and starts the same four ranks on loopback. Everything below
# still runs, but there is no uplink to count: the cells that count then also show what they printed
# in the run on racks this notebook was saved from, every line marked `saved |`.

# %%
# %load_ext distlab
import distlab
from distlab.cluster.nodes import nodes_here
from distlab.notebook.saved import saved_from_nodes

# True where emulated nodes can be made; elsewhere False, after one line saying why not
on_racks = nodes_here("4 ranks on loopback instead, so nothing below crosses an uplink", what="racks")
saved = saved_from_nodes("19-two-tiers-hsdp")   # without racks: what the cells printed on them, marked saved
racks = "--nodes 4 --racks 2 --link 1gbit --uplink 100mbit" if on_racks else ""

# %%
# %dist start -n 4 {racks}

# %%
# %dist status

# %% [markdown]
# Nodes fill the racks in order: `node0` and `node1` in `rack0`, `node2` and `node3` in `rack1`, so
# ranks 0 and 1 share a rack, as do ranks 2 and 3. `lab.racks` lists them. `lab.uplink_bytes()` reads
# what each rack's uplink has carried so far, up to the spine and down from it, from the kernel's
# counters on its two queues.

# %%
import torch
from distlab import theory

lab = distlab.current_lab()
MB = 1 << 20
LINK, UPLINK = 1e9 / 8, 1e8 / 8          # bytes per second, each way
print("ranks in each rack:", lab.racks if on_racks else "(no racks)")


def uplink_bytes():
    """{rack: (bytes up, bytes down)} so far; {} without racks."""
    return lab.uplink_bytes() if on_racks else {}


def crossed(before, after, runs=1):
    """Bytes each rack sent up its uplink per run, between two readings."""
    return {rack: (after[rack][0] - before[rack][0]) / runs for rack in after}


# %% [markdown]
# ## The slowest edge
#
# **Predict first.** Four ranks, one on each node, two nodes in each rack: each node joined to its
# rack's switch at 1 Gbit/s, each rack to the spine by a 100 Mbit/s uplink. An all-reduce of 8 MiB
# over the ring of all four, 0 → 1 → 2 → 3 → 0: how long, by the ring model without its latency
# term?

# %%
from distlab.quiz import predict

guess = predict("8 MiB all-reduced over the ring 0 -> 1 -> 2 -> 3 -> 0; ranks 0 and 1 in one rack, 2 and 3 in the "
                "other; 1 Gbit/s node links, 100 Mbit/s uplinks: how many seconds, without latency?",
                theory="tiered_allreduce_time_s", unit="s", tolerance=0.15, size_bytes=8 * MB,
                nodes=[0, 1, 2, 3], link_bytes_per_s=LINK, racks=[0, 0, 1, 1], uplink_bytes_per_s=UPLINK)
guess

# %% [markdown]
# `theory.ring_edge_bandwidths` gives the rate of each edge of a ring, ranks in order. An edge inside
# a node is loopback; one between nodes gets its share of the two node links it crosses; one between
# racks also gets its share of the two uplinks. Three rings:
#
# - ranks 0 and 1, in one rack;
# - ranks 0 and 2, one in each rack;
# - all 4 ranks: 0 → 1 → 2 → 3 → 0.

# %%
rings = {
    "0, 1 (one rack)": ([0, 1], [0, 0]),
    "0, 2 (two racks)": ([0, 2], [0, 1]),
    "0, 1, 2, 3": ([0, 1, 2, 3], [0, 0, 1, 1]),
}
S = 8 * MB
for name, (nodes, in_racks) in rings.items():
    rates = theory.ring_edge_bandwidths(nodes, LINK, in_racks, UPLINK)
    model = theory.tiered_allreduce_time_s(S, nodes, LINK, in_racks, UPLINK)
    print(f"ring {name:<17} edges at {', '.join(f'{r * 8 / 1e6:g}' for r in rates)} Mbit/s; "
          f"8 MiB all-reduce: {model:.3f} s")

# %% [markdown]
# The pair in one rack runs at the link's 1 Gbit/s. Every ring that leaves a rack runs at the
# uplink's 100 Mbit/s, for as long as its slowest edge takes. The 4-rank ring crosses each uplink once
# each way (1 → 2 up from rack 0, 3 → 0 up from rack 1), and every edge of a ring carries
# `2(N-1)/N * S` = 1.5 S. So each uplink carries 1.5 S each way, and the ring takes 1.5 S / B_uplink.
#
# **Then measure.** Each all-reduce runs once to warm up, then three times, and we keep the median
# over the three of the slowest rank's time.

# %%
# %%ddp
import time

one_rack, two_racks = dist.new_group([0, 1]), dist.new_group([0, 2])


def timed(op, members, runs=3):
    """Median of `runs` timings of op() on the slowest member; every rank calls it."""
    op() if rank in members else None                      # warm up: first connections, first buffers
    took = []
    for _ in range(runs):
        dist.barrier()
        t0 = time.perf_counter()
        if rank in members:
            op()
        took.append(time.perf_counter() - t0)
    t = torch.tensor(sorted(took)[runs // 2], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


x = torch.ones(8 * 2**20 // 4, device=device)
dist.barrier()

# %% [markdown]
# The runs go one ring at a time, with the uplinks' counters read around each (4 runs per ring, the
# warm-up included).

# %%
measured, up = {}, {}
groups = {"0, 1 (one rack)": ("one_rack", [0, 1]), "0, 2 (two racks)": ("two_racks", [0, 2]),
          "0, 1, 2, 3": ("None", [0, 1, 2, 3])}
for name, (group, members) in groups.items():
    before = uplink_bytes()
    out = lab.run(f"timed(lambda: dist.all_reduce(x, group={group}), {members})", stream=False)
    up[name] = crossed(before, uplink_bytes(), runs=4)
    measured[name] = out[0]
print(f"{'ring':<19} {'measured':>9} {'model':>8}   bytes up each uplink per all-reduce, in S")
for name, (nodes, in_racks) in rings.items():
    model = theory.tiered_allreduce_time_s(S, nodes, LINK, in_racks, UPLINK)
    counted = ", ".join(f"rack{r} {b / S:.2f}" for r, b in up[name].items()) or "(no uplinks)"
    print(f"{name:<19} {measured[name]:>8.3f}s {model:>7.3f}s   {counted}")
if not on_racks:
    saved("rings on racks")

# %% [markdown]
# The counters against the model, with margins for what else a link carries. A frame of 1,514 bytes
# on the wire carries 1,448 bytes of data (notebook 12), so the data costs at least 1.046 times its
# size on a link. The ranks also exchange small control messages with the controller, which sits on
# the spine.

# %% tags=["nbval-check-output"]
if on_racks:
    def within(name, model_s):
        return all(model_s * S <= b < 1.2 * model_s * S for b in up[name].values())

    print("one rack: under 1% of S crossed an uplink:", all(b < 0.01 * S for b in up["0, 1 (one rack)"].values()))
    print("two racks: each uplink carried 1.0 S to 1.2 S up:", within("0, 2 (two racks)", 1.0))
    print("4 ranks: each uplink carried 1.5 S to 1.8 S up (one ring edge):", within("0, 1, 2, 3", 1.5))
    print("the pair in one rack was at least 3x faster than the pair across:",
          measured["0, 1 (one rack)"] * 3 < measured["0, 2 (two racks)"])
else:
    saved("rings on racks: checks")

# %% [markdown]
# Inside a rack the all-reduce never touches an uplink. Across racks the bytes are the model's, plus
# the headers. The times are above the model by a little more than the headers' share, as on the
# star of notebook 12 (3-10% above it on this machine, in `benchmarks/RESULTS.md`). The ratio between
# the tiers is the links' ratio.
#
# ## HSDP: which collectives cross the uplinks
#
# FSDP2 (`fully_shard`) shards every parameter over a group of ranks. In each step it all-gathers the
# parameters for forward, all-gathers them again for backward (`reshard_after_forward=True`, the
# default), and reduce-scatters the gradients. On a mesh of two dimensions `(replicate, shard)` it
# does all of that inside each *shard* group. Each rank then holds a shard of the gradients, and the
# ranks that hold the same shard all-reduce it across the *replicate* group. That is HSDP.
#
# Which ranks form a group is the mesh's layout, and that decides what crosses the uplinks:
#
# | layout | shard groups | replica groups |
# |---|---|---|
# | flat (1-D mesh of 4) | all four ranks | none |
# | HSDP, `[[0, 1], [2, 3]]` | one per rack | across racks: {0, 2}, {1, 3} |
# | the wrong way, `[[0, 2], [1, 3]]` | across racks | one per rack |
#
# **Predict first**: under HSDP, how many times the model's bytes go up each uplink per step? Count
# the ring edges that leave each rack, group by group (`theory.fsdp_uplink_bytes_per_step` does the
# same, and grades your guess). Two facts enter:
#
# - The model has Psi bytes of float32 parameters.
# - gloo's reduce-scatter moves an all-reduce's bytes, `2(N-1)/N * S` and not `(N-1)/N * S` (measured
#   in notebook 14), so the theory is told `reduce_scatter="all_reduce"`.

# %%
from distlab.quiz import predict

WIDTH, BLOCKS = 512, 4
psi = 4 * (BLOCKS * (WIDTH * WIDTH + WIDTH) + WIDTH + 1)       # float32 bytes of the model below
print(f"parameters: {psi / 4:,.0f}, Psi = {psi / MB:.2f} MiB")
LAYOUTS = ("flat", "hsdp", "shard-across")
predicted = {layout: theory.fsdp_uplink_bytes_per_step(psi, 2, 2, layout, reduce_scatter="all_reduce")
             for layout in LAYOUTS}


def uplink_psi(layout):
    """Psi up each uplink per step on gloo, for 2 racks of 2 ranks."""
    return theory.fsdp_uplink_bytes_per_step(psi, 2, 2, layout, reduce_scatter="all_reduce") / psi


guess = predict("HSDP, a shard group in each of 2 racks: how many Psi go up each uplink per step, on gloo?",
                theory=uplink_psi, tolerance=0.1, layout="hsdp")
guess

# %% [markdown]
# Flat FSDP's one ring over the four ranks crosses each uplink once, for each of its three
# collectives. HSDP keeps all three inside the racks: only the all-reduce of each half of the
# gradients crosses, once per uplink for each of the two replica groups. The wrong way round sends
# all three collectives of both shard groups across the uplinks, which is more than flat FSDP sends.
#
# **Then measure.** The same model, data and SGD in each layout: each rank draws its own batch of 64.
# There is one step to warm up (the first all-gathers open connections), then three steps with the
# uplinks' counters read around them.

# %%
# %%ddp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

WIDTH, BLOCKS = 512, 4


def make_model():
    torch.manual_seed(0)                                        # the same start on every rank, every layout
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 1))


def mesh_for(layout):
    if layout == "flat":
        return init_device_mesh(device.type, (world_size,))
    if layout == "hsdp":                                        # rows shard (inside a rack), columns replicate
        return init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    return DeviceMesh(device.type, [[0, 2], [1, 3]], mesh_dim_names=("replicate", "shard"))


g = torch.Generator().manual_seed(rank)
inputs, targets = torch.randn(64, WIDTH, generator=g).to(device), torch.randn(64, 1, generator=g).to(device)


def build(layout):
    """A fresh model sharded by `layout`, its SGD and its mesh."""
    mesh = mesh_for(layout)
    model = make_model().to(device)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt, mesh


def step(model, opt):
    loss = ((model(inputs) - targets) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


dist.barrier()

# %%
STEPS = 3
results = {}
for layout in LAYOUTS:
    lab.run(f"model, opt, mesh = build({layout!r})\nlosses = [step(model, opt)]\ndist.barrier()", stream=False)
    before = uplink_bytes()
    lab.run(f"t0 = time.perf_counter()\nlosses += [step(model, opt) for _ in range({STEPS})]\n"
            f"dist.barrier()\nstep_s = (time.perf_counter() - t0) / {STEPS}", stream=False)
    results[layout] = {
        "up": crossed(before, uplink_bytes(), runs=STEPS),
        "step_s": max(lab.pull("step_s").values()),
        "losses": lab.pull("losses")[0],
        "groups": lab.run("[sorted(dist.get_process_group_ranks(g)) for g in mesh.get_all_groups()]",
                          stream=False, ranks=[0])[0],
    }
print(f"{'layout':<13} {'rank 0 groups':<26} {'step':>7}   up each uplink per step, in Psi (model)")
for layout, r in results.items():
    counted = ", ".join(f"rack{k} {b / psi:.2f}" for k, b in r["up"].items()) or "(no uplinks)"
    print(f"{layout:<13} {str(r['groups']):<26} {r['step_s']:>6.3f}s   {counted} ({predicted[layout] / psi:.2f})")
if not on_racks:
    saved("layouts")

# %% [markdown]
# The groups column lists rank 0's groups: for a 2-D mesh, the replicate group, then the shard group.
# Each layout's bytes follow its model, with the headers' share on top. The step times follow the
# bytes: at 100 Mbit/s the uplinks, not the CPUs, set the pace of a step here.

# %% tags=["nbval-check-output"]
if on_racks:
    for layout, r in results.items():
        ok = all(predicted[layout] <= b < 1.2 * predicted[layout] for b in r["up"].values())
        print(f"{layout}: each uplink carried 1.0 to 1.2 times the model's bytes:", ok)
    print("HSDP's step took less time than flat FSDP's:", results["hsdp"]["step_s"] < results["flat"]["step_s"])
    print("the wrong way round took more time than HSDP:", results["hsdp"]["step_s"] < results["shard-across"]["step_s"])
else:
    saved("layouts: checks")

# %% [markdown]
# The theory for every layout, then your prediction against what HSDP's uplinks carried (the busier
# of the two):

# %%
for layout in LAYOUTS:
    nccl = theory.fsdp_uplink_bytes_per_step(psi, 2, 2, layout)
    print(f"{layout:<13} up each uplink per step: {predicted[layout] / psi:.2f} Psi on gloo "
          f"({nccl / psi:.2f} Psi with a ring reduce-scatter); at 100 Mbit/s at least "
          f"{predicted[layout] / UPLINK:.2f} s of uplink time per step")
guess.reveal(max(results["hsdp"]["up"].values()) / psi) if on_racks else "no racks here: the saved run's table above"

# %% [markdown]
# The layout changes where the bytes go, not what is computed. Each step averages the gradients of
# the same four batches, whichever groups do the averaging. So the three runs train the same model,
# up to the order in which floats are added:

# %% tags=["nbval-check-output"]
flat_losses = results["flat"]["losses"]
for layout in ("hsdp", "shard-across"):
    apart = max(abs(a - b) for a, b in zip(results[layout]["losses"], flat_losses))
    print(f"{layout}: the same losses as flat FSDP, step by step, to within 1e-5:", apart < 1e-5)

# %%
print("losses, flat:", [f"{v:.5f}" for v in flat_losses])

# %% [markdown]
# At scale the same arithmetic holds with the tiers of a real cluster. A node's GPUs share its
# fastest links, and the network above the node is slower per GPU. So HSDP's shard groups are
# usually a node, or a rack, and its replicas span the rest. The bytes that cross the slow tier are
# then `2(R-1)/R * Psi` per step, whatever the size of a shard group.
#
# ## Practice

# %%
# %quiz communication-cost -n 3 --seed 19

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise clip-sharded-gradients`: clip the gradients of a model FSDP2 shards by the whole
#   gradient's norm, from each rank's shards and one all-reduce of a single number, as
#   `torch.nn.utils.clip_grad_norm_` does on one process.

# %%
# %dist stop
