"""What watching costs: DDP step throughput with ``distlab.watch`` at its defaults, closed, and absent.

Two gloo ranks of a real lab train four copies of the same MLP (same seed, same batches): one never
watched (the baseline), a second never watched (its twin: what this machine's noise alone reads),
one watched at the defaults (every bucket timed, per-layer norms and a checksum every 50 steps,
one publish a second), and one watched and then closed. Chunks of just under two publish
intervals rotate through the copies, each followed by a pause of one interval, many rounds, so
drift and the neighbour's load hit all alike, and every publish is paid for in the watched copy's
own chunk (without the pause, half of them landed in the next copy's). Every few rounds the four
copies are built afresh in a random order, so no role keeps a lucky or unlucky place in memory
for the whole run (a watch is opened on each new watched copy). Each rank is pinned to a core of its own. The table gives steps/s, and each copy's throughput relative to the
baseline: total steps over total time, with a 95% bootstrap interval over rounds, and the median
of per-round ratios, and the page faults each copy's steps took (rank 0's copies / rank 1's:
unwatched, twin, watched, closed), which show whether freed memory is being faulted back in.
The notebook
side runs as in use: telemetry store and dashboard on.

Then the watched model's all-reduce timings are checked against torch.profiler's ``gloo:all_reduce``
events over the same steps (the profiler runs only for that part).

    python benchmarks/bench_telemetry.py [--rounds 40] [--widths 256 1024 1732] [--options stats_every=0]
"""

from __future__ import annotations

import argparse
import ast
import random
import statistics

import distlab

# Runs on every rank. WIDTH, MIN_STEPS (per chunk), ROUNDS, REBUILD_EVERY, OPTIONS and PROFILE_STEPS are pushed by the client.
_RANK_CODE = r"""
import gc, os, random, resource, time
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

# One core each: without it the two ranks migrate across the two cores and chunk times scatter.
if len(os.sched_getaffinity(0)) >= world_size:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})

def _make():
    torch.manual_seed(0)
    w = WIDTH
    return torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.ReLU(), torch.nn.Linear(2 * w, w),
                               torch.nn.ReLU(), torch.nn.Linear(w, 10))

_x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(rank))
_y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(rank))
_NAMES = ("unwatched", "twin", "watched", "closed")
_shuffle = random.Random(0)  # the same order on every rank: building a DDP model is a collective
_copies, _opts, _watch = {}, {}, None

def _build():
    # Fresh copies, made in a new order each time: where a copy's tensors land in memory changes
    # its speed by a few percent for as long as it lives, so the copies are rebuilt every few
    # rounds and each role draws its memory at random (the twin shows what is left of it).
    global _copies, _opts, _watch
    if _watch is not None:
        _watch.close()
    _copies.clear()
    _opts.clear()
    gc.collect()
    for name in _shuffle.sample(_NAMES, len(_NAMES)):
        _copies[name] = DDP(_make())
    _copies = {name: _copies[name] for name in _NAMES}
    _opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in _copies.items()}
    distlab.watch(_copies["closed"]).close()
    _watch = distlab.watch(_copies["watched"], **OPTIONS)
    for name in _copies:
        _chunk(name, 3, count=False)  # warm-up, not timed: DDP rebuilds its buckets after the first step

_faults = {name: 0 for name in _NAMES}  # minor page faults while each copy trained

def _chunk(name, steps, count=True):
    model, opt = _copies[name], _opts[name]
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(_x), _y)
        loss.backward()
        opt.step()
        if name == "watched":  # log() reaches the open watch from any loop: only this one may call it
            distlab.log(loss=loss)
    elapsed = time.perf_counter() - t0
    if count:
        _faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return elapsed

_build()
# Chunks last just under two publish intervals, with a pause of one interval after each: a watched
# chunk then holds the publishes a watched run makes in that time (one at its start, one an interval
# later), and the publish its last steps ask for falls in the pause, not in the next copy's chunk.
_interval = _watch.config.publish_interval_s if _watch.config.publish else 0.0
_step_s = torch.tensor([_chunk("unwatched", 5) / 5])
dist.all_reduce(_step_s, op=dist.ReduceOp.MAX)  # both ranks must run the same number of steps
_steps = max(MIN_STEPS, round(1.9 * _interval / _step_s.item()))
_pause_s = _interval + 0.2 if _interval else 0.0
_order = list(_copies)
_times = {name: [] for name in _copies}
_faults = {name: 0 for name in _copies}  # counted from here: warm-up and chunk sizing left out
for r in range(ROUNDS):
    if r and r % REBUILD_EVERY == 0:
        _build()
    _order = _order[1:] + _order[:1]
    for name in _order:
        _times[name].append(_chunk(name, _steps))
        time.sleep(_pause_s)

# All-reduce times: ours against the profiler's, bucket by bucket in launch order, same steps.
_first = _watch.records()[-1]["step"] + 1
with profile(activities=[ProfilerActivity.CPU]) as _prof:
    _chunk("watched", PROFILE_STEPS)
_ours = [b["seconds"] for rec in _watch.records() if rec["step"] >= _first for b in sorted(rec["allreduce"], key=lambda b: b["start_s"])]
_theirs = [(e.time_range.start, (e.time_range.end - e.time_range.start) / 1e6)
           for e in _prof.events() if e.name == "gloo:all_reduce"]
_theirs = [d for _, d in sorted(_theirs)]
_watch.close()
os.sched_setaffinity(0, range(os.cpu_count()))
_params = sum(p.numel() for p in _copies["unwatched"].parameters())
(_params, _steps, _times, _ours, _theirs, {k: v / (ROUNDS * _steps) for k, v in _faults.items()})
"""


def relative(base: list[float], other: list[float], draws: int = 4000) -> tuple[float, float, float]:
    """Throughput of ``other`` relative to ``base`` (same steps each round): point and 95% interval."""
    pairs = list(zip(base, other))

    def ratio(sample: list[tuple[float, float]]) -> float:
        return sum(b for b, _ in sample) / sum(o for _, o in sample)

    rng = random.Random(0)
    boots = sorted(ratio(rng.choices(pairs, k=len(pairs))) for _ in range(draws))
    return ratio(pairs), boots[int(0.025 * draws)], boots[int(0.975 * draws)]


def _fmt(base: list[float], other: list[float]) -> str:
    point, low, high = relative(base, other)
    median = statistics.median(b / o for b, o in zip(base, other))
    return f"{100 * point:.1f}% [{100 * low:.1f}, {100 * high:.1f}], median {100 * median:.1f}%"


def _option(text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    return name, ast.literal_eval(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--rebuild-every", type=int, default=5,
                        help="rounds between fresh copies of the four models (new memory for each role)")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024, 1732],
                        help="MLP width w: 4w^2 parameters (0.27M, 4.2M, 12M)")
    parser.add_argument("--options", nargs="*", default=[], type=_option,
                        help="watch options for the watched copy, e.g. stats_every=0 publish=False")
    parser.add_argument("--no-dashboard", action="store_true",
                        help="leave the notebook side idle (what the ranks' own work costs, alone)")
    args = parser.parse_args()
    options = dict(args.options)
    with distlab.start(ranks=2, timeout=120) as lab:
        if not args.no_dashboard:
            lab.dashboard()  # the notebook side runs as in use: store merging, throttled redraws
        print(f"watch options: {options or 'defaults'}; {args.rounds} rounds; "
              f"dashboard {'off' if args.no_dashboard else 'on'}")
        print("| params | steps per chunk | unwatched (steps/s) | twin / unwatched (noise) | watched / unwatched "
              "| closed / unwatched | all-reduces | ours / profiler (total) | per-bucket median abs diff | page faults per step (rank 0 / 1 / ...) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for width in args.widths:
            lab.push(WIDTH=width, MIN_STEPS=10, ROUNDS=args.rounds, REBUILD_EVERY=args.rebuild_every, PROFILE_STEPS=10, OPTIONS=options)
            results = lab.run(_RANK_CODE, stream=False, timeout=3600)
            params, steps, times, ours, theirs, _ = results[0]
            faults = " / ".join(", ".join(f"{f:.0f}" for f in results[rank][5].values()) for rank in sorted(results))
            base = times["unwatched"]
            n = min(len(ours), len(theirs))
            diffs = [abs(a - b) / b for a, b in zip(ours[:n], theirs[:n]) if b > 0] or [float("nan")]
            total = sum(ours[:n]) / sum(theirs[:n]) if n else float("nan")
            print(
                f"| {params / 1e6:.2f}M | {steps} | {steps * len(base) / sum(base):.1f} "
                f"| {_fmt(base, times['twin'])} | {_fmt(base, times['watched'])} | {_fmt(base, times['closed'])} "
                f"| {n} (ours {len(ours)}, profiler {len(theirs)}) | {total:.3f} "
                f"| {100 * statistics.median(diffs):.1f}% | {faults} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
