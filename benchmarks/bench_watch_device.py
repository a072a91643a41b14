"""A DDP step watched against unwatched, on the ranks' own device (a GPU where there is one).

The ranks of a real lab (``--backend auto``: NCCL with a GPU per rank, gloo sharing the GPUs
otherwise, the CPU without one) train two copies of one MLP with the same seed and batches: one
never watched (the baseline), one watched at the defaults (every all-reduce bucket timed, with CUDA
events on a GPU; norms and a checksum every 50 steps; a publish a second). Chunks of steps
alternate between the copies over many rounds, so drift hits both alike; each chunk ends with the
device synchronised, so its time is the GPU's work and not its queueing. The table gives steps/s
and the watched copy's throughput relative to the baseline (median of per-round ratios, and its
spread over rounds).

    python benchmarks/bench_watch_device.py [--ranks 2] [--backend auto] [--width 2048] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics

import distlab

# Runs on every rank; WIDTH, STEPS (per chunk) and ROUNDS are pushed.
_RANK_CODE = r"""
import time
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

def _make():
    torch.manual_seed(0)
    w = WIDTH
    return DDP(torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(), torch.nn.Linear(4 * w, w),
                                   torch.nn.GELU(), torch.nn.Linear(w, 10)).to(device))

_x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(rank)).to(device)
_y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(rank)).to(device)
_copies = {name: _make() for name in ("unwatched", "watched")}
_opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in _copies.items()}
_watch = distlab.watch(_copies["watched"])

def _sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def _chunk(name):
    model, opt = _copies[name], _opts[name]
    _sync()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(_x), _y)
        loss.backward()
        opt.step()
        if name == "watched":
            distlab.log(loss=loss)
    _sync()
    return time.perf_counter() - t0

for name in _copies:  # warm: buckets rebuilt, allocator and kernels settled
    _chunk(name)
_times = {name: [] for name in _copies}
for r in range(ROUNDS):
    for name in (("unwatched", "watched") if r % 2 == 0 else ("watched", "unwatched")):
        _times[name].append(_chunk(name))
_watch.close()
(_times, str(device), dist.get_backend())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20, help="steps per chunk")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with distlab.start(ranks=args.ranks, backend=args.backend, timeout=600) as lab:
        lab.push(WIDTH=args.width, STEPS=args.steps, ROUNDS=args.rounds)
        times, device, backend = lab.run(_RANK_CODE, stream=False, timeout=3600)[0]
    ratios = [u / w for u, w in zip(times["unwatched"], times["watched"])]
    rate = {name: args.steps * len(t) / sum(t) for name, t in times.items()}
    q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
    print(f"{args.ranks} ranks, {backend} on {device}, MLP width {args.width}, {args.rounds} rounds of "
          f"{args.steps} steps per copy (rank 0's times)")
    print("| copy | steps/s | relative to unwatched (median of rounds) | 10th-90th percentile |")
    print("|---|---|---|---|")
    print(f"| unwatched (baseline) | {rate['unwatched']:.1f} | 1.000 | |")
    print(f"| watched (defaults) | {rate['watched']:.1f} | {statistics.median(ratios):.3f} | {q[0]:.3f}-{q[-1]:.3f} |")


if __name__ == "__main__":
    main()
