"""Labs on emulated nodes, measured: all-reduce across shaped links against the ring model, a flat
ring against a hierarchical all-reduce, what the shaping costs the CPU, and time to ready.

1. ring: one rank per node (N = 2, 3, 4 nodes), links of 100 Mbit/s and 1 Gbit/s, all-reduce of
   1-64 MB (float32). Theory: ``distlab.theory.ring_allreduce_time_s`` with B the link's set rate
   and the latency a fitted on small messages (4 and 64 KiB) of the same lab and link.
2. hierarchical: 2 nodes x 2 ranks: gloo's flat ring over the 4 ranks against reduce within each
   node, all-reduce across the two node leaders, broadcast within each node (subgroups). Theory: the
   flat ring's two cross-node edges each carry 2(N-1)/N * S = 1.5 S each way; the leaders' ring
   carries S: 1.5 S / B against S / B (the loopback steps inside a node are left out).
3. shaping: a compute-bound DDP step (small model, large batch) on 2 nodes x 2 ranks at 10 Gbit/s,
   against the same nodes with links not shaped (what tbf itself costs) and the same 4 ranks on plain
   loopback (what the namespaces' network path costs); labs alternate.
4. ready: ``distlab.start(ranks=4, nodes=2, link="1gbit")`` against ``distlab.start(ranks=4)``; alternate.
5. tiers: two tiers, 4 nodes in 2 racks (one rank each), links of 1 Gbit/s, uplinks of 100 and
   250 Mbit/s: all-reduce of 4-16 MB inside a rack, across racks (2 ranks) and over all 4 ranks.
   Theory: ``distlab.theory.tiered_allreduce_time_s`` (the ring at its slowest edge's share) with the
   latency a fitted on small messages of the same group; and the bytes each uplink carried up, against
   ``ring_uplink_crossings`` x 2(N-1)/N S.

    python benchmarks/bench_network.py [--repeats 5] [--only ring hierarchical shaping ready tiers]

Needs root (CAP_NET_ADMIN). Each table prints as Markdown.
"""

from __future__ import annotations

import argparse
import statistics
import time

import distlab
from distlab import theory

MB = 2**20
TIME_ALL_REDUCE = """
import time
x = torch.ones({n})
times = []
for _ in range({repeats}):
    dist.barrier({group})
    t0 = time.perf_counter()
    dist.all_reduce(x{group_kw})
    times.append(time.perf_counter() - t0)
times
"""


def _median_time(lab: distlab.Lab, size_bytes: int, repeats: int, ranks: list[int] | None = None,
                 group: str = "") -> float:
    """Median over repeats of the slowest rank's all-reduce time (what the collective costs)."""
    code = TIME_ALL_REDUCE.format(
        n=size_bytes // 4, repeats=repeats, group=f"group={group}" if group else "",
        group_kw=f", group={group}" if group else "",
    )
    per_rank = lab.run(code, ranks=ranks, stream=False, timeout=600)
    return statistics.median(max(ts[i] for ts in per_rank.values()) for i in range(repeats))


def ring(repeats: int) -> None:
    print("| link | N nodes | size | measured (s) | ring model (s) | apart | fitted a (us) |")
    print("|---|---|---|---|---|---|---|")
    for n in (2, 3, 4):
        lab = distlab.start(ranks=n, nodes=n, link="100mbit", timeout=120)
        try:
            for link, sizes in (("100mbit", (1, 4, 16)), ("1gbit", (1, 4, 16, 64))):
                lab.set_link(link)
                bandwidth = lab.link.bytes_per_s
                _median_time(lab, 4 * MB, 1)  # warm up: first connections, first buffers
                small = [(s, _median_time(lab, s, repeats * 2)) for s in (4096, 65536)]
                # What the bandwidth term leaves, per step of the ring: 2(N-1) steps per all-reduce.
                a = statistics.median(
                    max(0.0, (t - theory.ring_allreduce_time_s(s, n, bandwidth)) / (2 * (n - 1))) for s, t in small
                )
                for size_mb in sizes:
                    measured = _median_time(lab, size_mb * MB, repeats)
                    model = theory.ring_allreduce_time_s(size_mb * MB, n, bandwidth, a)
                    print(f"| {link} | {n} | {size_mb} MB | {measured:.3f} | {model:.3f} | "
                          f"{(measured - model) / model:+.1%} | {a * 1e6:.0f} |", flush=True)
        finally:
            lab.stop()


HIERARCHY = """
node_group = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
leaders = dist.new_group([0, 2])
leader = rank // 2 * 2

def hierarchical_all_reduce(x):
    dist.reduce(x, dst=leader, group=node_group)        # within the node: loopback
    if rank == leader:
        dist.all_reduce(x, group=leaders)               # across nodes: the link
    dist.broadcast(x, src=leader, group=node_group)     # within the node again
"""

TIME_BOTH = """
import time
x = torch.arange({n}, dtype=torch.float32) % 7 + rank
flat, hier = x.clone(), x.clone()
dist.all_reduce(flat); hierarchical_all_reduce(hier)
assert torch.equal(flat, hier)  # small integers in float32: both sums are exact
flat_t, hier_t = [], []
for _ in range({repeats}):
    dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(x); flat_t.append(time.perf_counter() - t0)
    dist.barrier(); t0 = time.perf_counter(); hierarchical_all_reduce(x); hier_t.append(time.perf_counter() - t0)
(flat_t, hier_t)
"""


def hierarchical(repeats: int) -> None:
    print("| link | size | flat ring (s) | theory 1.5 S/B (s) | hierarchical (s) | theory S/B (s) | "
          "link bytes per node, flat / hierarchical |")
    print("|---|---|---|---|---|---|---|")
    lab = distlab.start(ranks=4, nodes=2, link="100mbit", timeout=120)
    try:
        lab.run(HIERARCHY, stream=False)
        for link, size_mb in (("100mbit", 4), ("100mbit", 16), ("1gbit", 16), ("1gbit", 64)):
            lab.set_link(link)
            bandwidth = lab.link.bytes_per_s
            out = lab.run(TIME_BOTH.format(n=size_mb * MB // 4, repeats=repeats), stream=False, timeout=600)
            flat = statistics.median(max(out[r][0][i] for r in out) for i in range(repeats))
            hier = statistics.median(max(out[r][1][i] for r in out) for i in range(repeats))
            sent = []
            for name in ("dist.all_reduce(x)", "hierarchical_all_reduce(x)"):
                before = lab.link_bytes()
                lab.run(f"x = torch.ones({size_mb * MB // 4})\n{name}", stream=False, timeout=600)
                after = lab.link_bytes()
                sent.append(statistics.mean(after[i] - before[i] for i in after) / (size_mb * MB))
            size = size_mb * MB
            print(f"| {link} | {size_mb} MB | {flat:.3f} | {1.5 * size / bandwidth:.3f} | {hier:.3f} | "
                  f"{size / bandwidth:.3f} | {sent[0]:.2f} S / {sent[1]:.2f} S |", flush=True)
    finally:
        lab.stop()


STEP = """
import time
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4096, 256)
times = []
for _ in range({steps}):
    dist.barrier(); t0 = time.perf_counter()
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    times.append(time.perf_counter() - t0)
times[2:]
"""


def shaping(repeats: int) -> None:
    print("| lab | step (s), median of runs | runs |")
    print("|---|---|---|")
    labs = (
        ("4 ranks, loopback", {}),
        ("2 nodes x 2 ranks, links not shaped", {"nodes": 2}),
        ("2 nodes x 2 ranks, 10gbit link", {"nodes": 2, "link": "10gbit"}),
    )
    results: dict[str, list[float]] = {name: [] for name, _ in labs}
    for _ in range(repeats):
        for name, kwargs in labs:
            with distlab.start(ranks=4, timeout=120, **kwargs) as lab:
                out = lab.run(STEP.format(steps=12), stream=False, timeout=600)
                results[name].append(statistics.median(max(out[r][i] for r in out) for i in range(10)))
    for name, runs in results.items():
        print(f"| {name} | {statistics.median(runs):.3f} | {', '.join(f'{r:.3f}' for r in runs)} |")


def ready(repeats: int) -> None:
    print("| start | ready (s), median | runs |")
    print("|---|---|---|")
    results: dict[str, list[float]] = {"distlab.start(ranks=4)": [], 'distlab.start(ranks=4, nodes=2, link="1gbit")': []}
    for _ in range(repeats):
        for name, kwargs in (("distlab.start(ranks=4)", {}),
                             ('distlab.start(ranks=4, nodes=2, link="1gbit")', {"nodes": 2, "link": "1gbit"})):
            t0 = time.perf_counter()
            lab = distlab.start(ranks=4, timeout=120, **kwargs)
            results[name].append(time.perf_counter() - t0)
            lab.stop()
    for name, runs in results.items():
        print(f"| `{name}` | {statistics.median(runs):.2f} | {', '.join(f'{r:.2f}' for r in runs)} |")


TIER_GROUPS = {  # name: (ranks, their nodes, their racks) with one rank per node, racks [[0, 1], [2, 3]]
    "in a rack": ([0, 1], [0, 1], [0, 0]),
    "across racks": ([0, 2], [0, 2], [0, 1]),
    "all 4": ([0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 1, 1]),
}


def tiers(repeats: int) -> None:
    print("| uplink | group | size | measured (s) | model (s) | apart | fitted a (us) | uplink bytes up, measured / model |")
    print("|---|---|---|---|---|---|---|---|")
    lab = distlab.start(ranks=4, nodes=4, racks=2, link="1gbit", uplink="100mbit", timeout=120)
    try:
        lab.run("groups = {'in a rack': dist.new_group([0, 1]), 'across racks': dist.new_group([0, 2]), "
                "'all 4': dist.group.WORLD}", stream=False)
        link = lab.link.bytes_per_s
        for uplink_rate in ("100mbit", "250mbit"):
            uplink = lab.set_uplink(uplink_rate).bytes_per_s
            for name, (ranks, nodes, racks) in TIER_GROUPS.items():
                group = f"groups[{name!r}]"
                _median_time(lab, 4 * MB, 1, ranks, group)  # warm up: first connections, first buffers
                small = [(s, _median_time(lab, s, repeats * 2, ranks, group)) for s in (4096, 65536)]
                steps = 2 * (len(ranks) - 1)
                a = statistics.median(max(0.0, (t - theory.tiered_allreduce_time_s(s, nodes, link, racks, uplink)) / steps)
                                      for s, t in small)
                for size_mb in (4, 16):
                    size = size_mb * MB
                    before = lab.uplink_bytes()
                    measured = _median_time(lab, size, repeats, ranks, group)
                    after = lab.uplink_bytes()
                    up = max(after[k][0] - before[k][0] for k in after) / repeats
                    crossings = max(theory.ring_uplink_crossings(racks).values(), default=0)
                    model_up = crossings * theory.ring_allreduce_sent_bytes(size, len(ranks))
                    model = theory.tiered_allreduce_time_s(size, nodes, link, racks, uplink, a)
                    ratio = f"{up / size:.2f} S / {model_up / size:.2f} S" if model_up else f"{up / size:.3f} S / 0"
                    print(f"| {uplink_rate} | {name} | {size_mb} MB | {measured:.3f} | {model:.3f} | "
                          f"{(measured - model) / model:+.1%} | {a * 1e6:.0f} | {ratio} |", flush=True)
    finally:
        lab.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="+", default=["ring", "hierarchical", "shaping", "ready", "tiers"])
    args = parser.parse_args()
    for name in args.only:
        print(f"\n### {name}\n", flush=True)
        {"ring": ring, "hierarchical": hierarchical, "shaping": shaping, "ready": ready, "tiers": tiers}[name](
            args.repeats
        )


if __name__ == "__main__":
    main()
