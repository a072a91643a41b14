"""What watching costs on an FSDP2 model and on a tensor-parallel model, next to DDP's.

Two gloo ranks of a real lab (one core each) train three layouts of the same MLP (4 layers of
WIDTH, Adam): DDP, FSDP2 (``fully_shard`` per layer) and tensor parallel (column- then row-wise
pairs). Each layout has three copies with the same weights and batches: never watched (the
baseline), watched at the defaults (every collective timed, memory tracked, norms and checksums
every 50 steps, a publish a second), and watched with ``track_memory=False`` (what the live-tensor
count costs: on the CPU every op of a step passes through the watch's dispatch mode for it).
Chunks of about CHUNK_S seconds (a fixed number of steps per layout) rotate through the nine copies in a new random order each round, so drift
and the neighbour's load hit all alike. The table gives each copy's steps/s relative to its layout's
unwatched copy: total steps over total time, with a 95% bootstrap interval over rounds.

    python benchmarks/bench_watch_parallel.py [--rounds 12] [--width 512] [--chunk-s 1.5]
"""

from __future__ import annotations

import argparse
import random
import statistics

import distlab

_RANK_CODE = r"""
import os, time
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
from distlab.telemetry import Watch, WatchConfig
from distlab.rank.publish import engine_sender

if len(os.sched_getaffinity(0)) >= world_size:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
torch.set_num_threads(1)
_mesh = init_device_mesh("cpu", (world_size,))

def _mlp():
    torch.manual_seed(0)
    w = WIDTH
    return torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.ReLU(), torch.nn.Linear(2 * w, w),
                               torch.nn.ReLU(), torch.nn.Linear(w, 2 * w), torch.nn.ReLU(), torch.nn.Linear(2 * w, w))

def _layout(kind):
    model = _mlp()
    if kind == "ddp":
        return DDP(model)
    if kind == "fsdp2":
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=_mesh)
        return fully_shard(model, mesh=_mesh)
    return parallelize_module(model, _mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                             "4": ColwiseParallel(), "6": RowwiseParallel()})

# DDP ranks see their own data; tensor-parallel ranks must see the same batch (the layout needs it).
_x = {k: torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(0 if k == "tp" else rank)) for k in KINDS}
_copies = {}
for kind in KINDS:
    for role in ROLES:
        model = _layout(kind)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        w = None
        # Watch(...) itself, not distlab.watch(): that closes the watch open before it, and here
        # six stay open at once, each on its own model.
        if role == "watched":
            w = Watch(model, WatchConfig(), engine_sender())
        elif role == "no memory":
            w = Watch(model, WatchConfig(track_memory=False), engine_sender())
        _copies[(kind, role)] = (model, opt, w)

def _chunk(kind, role, steps):
    # A fixed number of steps, the same on both ranks: the layouts' collectives need both ranks in them.
    model, opt, w = _copies[(kind, role)]
    x = _x[kind]
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    elapsed = time.perf_counter() - t0
    if w is not None:
        w.flush()  # what a cell's end does: the observer is off between chunks
    return steps, elapsed
"""

KINDS = ("ddp", "fsdp2", "tp")
ROLES = ("unwatched", "watched", "no memory")


def _interval(steps: list[int], times: list[float], base_steps: list[int], base_times: list[float]) -> tuple[float, float, float]:
    ratio = (sum(steps) / sum(times)) / (sum(base_steps) / sum(base_times))
    rng = random.Random(0)
    boots = []
    n = len(steps)
    for _ in range(2000):
        pick = [rng.randrange(n) for _ in range(n)]
        s = sum(steps[i] for i in pick) / sum(times[i] for i in pick)
        b = sum(base_steps[i] for i in pick) / sum(base_times[i] for i in pick)
        boots.append(s / b)
    boots.sort()
    return ratio, boots[int(0.025 * len(boots))], boots[int(0.975 * len(boots)) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--chunk-s", type=float, default=1.5)
    args = parser.parse_args()
    with distlab.start(ranks=2, timeout=60) as lab:
        lab.push(WIDTH=args.width, KINDS=KINDS, ROLES=ROLES)
        lab.run(_RANK_CODE, stream=False)
        order = [(k, r) for k in KINDS for r in ROLES]
        chunk_steps = {}
        for kind in KINDS:  # warm-up, and the steps a chunk of about chunk_s seconds takes
            out = lab.run(f"_chunk({kind!r}, 'unwatched', 5)", stream=False)
            per_step = max(v[1] for v in out.values()) / 5
            chunk_steps[kind] = max(3, round(args.chunk_s / per_step))
        shuffle = random.Random(1)
        steps: dict[tuple[str, str], list[int]] = {c: [] for c in order}
        times: dict[tuple[str, str], list[float]] = {c: [] for c in order}
        for _ in range(args.rounds):
            shuffle.shuffle(order)
            for kind, role in order:
                out = lab.run(f"_chunk({kind!r}, {role!r}, {chunk_steps[kind]})", stream=False)
                slowest = max(out.values(), key=lambda v: v[1])
                steps[(kind, role)].append(slowest[0])
                times[(kind, role)].append(slowest[1])
    print(f"2 gloo ranks, one core each; MLP width {args.width} (4 Linear layers, Adam, batch 64); "
          f"{args.rounds} rounds of {args.chunk_s} s chunks\n")
    print("| layout | copy | steps/s | relative to unwatched | 95% interval | median step (ms) |")
    print("|---|---|---|---|---|---|")
    for kind in KINDS:
        base = (kind, "unwatched")
        for role in ROLES:
            s, t = steps[(kind, role)], times[(kind, role)]
            rate = sum(s) / sum(t)
            ratio, lo, hi = _interval(s, t, steps[base], times[base])
            per_step = statistics.median(ti / si for si, ti in zip(s, t)) * 1e3
            print(f"| {kind} | {role} | {rate:.1f} | {ratio:.3f} | {lo:.3f}-{hi:.3f} | {per_step:.1f} |")


if __name__ == "__main__":
    main()
