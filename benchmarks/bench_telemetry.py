"""What watching costs: DDP step throughput with ``distlab.watch`` at its defaults, closed, and absent.

Two gloo ranks of a real lab train three copies of the same MLP (same seed, same batches), one
never watched, one watched (defaults: every bucket timed, per-layer norms and a checksum every 10
steps, 4 publishes a second), one watched and then closed (its DDP hook stays, switched off).
Chunks of steps alternate between the three in a rotating order, many rounds, so drift and the
neighbour's load hit all alike; the table shows median steps/s and the median of per-round
ratios to the unwatched copy. The notebook side runs as in use: telemetry store and dashboard on.

Then the watched model's all-reduce timings are checked against torch.profiler's ``gloo:all_reduce``
events over the same steps (the profiler runs only for that part).

    python benchmarks/bench_telemetry.py [--rounds 20] [--widths 256 1024 1732]
"""

from __future__ import annotations

import argparse
import statistics

import distlab

# Runs on every rank. WIDTH, STEPS, ROUNDS and PROFILE_STEPS are pushed by the client.
_RANK_CODE = r"""
import statistics, time
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

def _make():
    torch.manual_seed(0)
    w = WIDTH
    return torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.ReLU(), torch.nn.Linear(2 * w, w),
                               torch.nn.ReLU(), torch.nn.Linear(w, 10))

_x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(rank))
_y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(rank))
_copies = {name: DDP(_make()) for name in ("unwatched", "watched", "closed")}
_opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in _copies.items()}
distlab.watch(_copies["closed"]).close()
_watch = distlab.watch(_copies["watched"])

def _chunk(name, steps):
    model, opt = _copies[name], _opts[name]
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(_x), _y)
        loss.backward()
        opt.step()
        if name == "watched":
            distlab.log(loss=loss)
    return time.perf_counter() - t0

for name in _copies:
    _chunk(name, 3)  # warm-up: DDP rebuilds its buckets after the first step
_order = list(_copies)
_times = {name: [] for name in _copies}
for r in range(ROUNDS):
    _order = _order[1:] + _order[:1]
    for name in _order:
        _times[name].append(_chunk(name, STEPS))

# All-reduce times: ours against the profiler's, bucket by bucket in launch order, same steps.
_first = _watch.records()[-1]["step"] + 1
with profile(activities=[ProfilerActivity.CPU]) as _prof:
    _chunk("watched", PROFILE_STEPS)
_ours = [b["seconds"] for rec in _watch.records() if rec["step"] >= _first for b in sorted(rec["allreduce"], key=lambda b: b["start_s"])]
_theirs = [(e.time_range.start, (e.time_range.end - e.time_range.start) / 1e6)
           for e in _prof.events() if e.name == "gloo:all_reduce"]
_theirs = [d for _, d in sorted(_theirs)]
_watch.close()
_params = sum(p.numel() for p in _copies["unwatched"].parameters())
(_params, _times, _ours, _theirs)
"""


def _fmt_ratio(values: list[float]) -> str:
    return f"{100 * statistics.median(values):.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024, 1732],
                        help="MLP width w: 4w^2 parameters (0.27M, 4.2M, 12M)")
    args = parser.parse_args()
    with distlab.start(ranks=2, timeout=120) as lab:
        lab.dashboard()  # the notebook side runs as in use: store merging, throttled redraws
        print("| params | steps/chunk | unwatched (steps/s) | watched (steps/s) | watched / unwatched "
              "| closed (steps/s) | closed / unwatched | all-reduces | ours / profiler (total) "
              "| per-bucket median abs diff |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for width in args.widths:
            # Chunks of a multiple of 10 steps: each holds the same number of sampled steps.
            steps = 50 if width <= 512 else 10
            lab.push(WIDTH=width, STEPS=steps, ROUNDS=args.rounds, PROFILE_STEPS=10)
            params, times, ours, theirs = _run(lab)
            rate = {name: [steps / t for t in ts] for name, ts in times.items()}
            watched = [u / w for u, w in zip(times["unwatched"], times["watched"])]
            closed = [u / c for u, c in zip(times["unwatched"], times["closed"])]
            n = min(len(ours), len(theirs))
            diffs = [abs(a - b) / b for a, b in zip(ours[:n], theirs[:n]) if b > 0] or [float("nan")]
            total = sum(ours[:n]) / sum(theirs[:n]) if n else float("nan")
            print(
                f"| {params / 1e6:.2f}M | {steps} | {statistics.median(rate['unwatched']):.1f} "
                f"| {statistics.median(rate['watched']):.1f} | {_fmt_ratio(watched)} "
                f"| {statistics.median(rate['closed']):.1f} | {_fmt_ratio(closed)} "
                f"| {n} (ours {len(ours)}, profiler {len(theirs)}) | {total:.3f} "
                f"| {100 * statistics.median(diffs):.1f}% |",
                flush=True,
            )


def _run(lab: distlab.Lab) -> tuple[int, dict[str, list[float]], list[float], list[float]]:
    """Run the benchmark cell on every rank; rank 0's numbers (steps are in lockstep across ranks)."""
    return lab.run(_RANK_CODE, stream=False, timeout=900)[0]  # type: ignore[no-any-return]


if __name__ == "__main__":
    main()
