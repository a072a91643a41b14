"""What ``lab.profile`` costs: a DDP training step on 2 ranks with torch.profiler recording, against
the same step unprofiled (the baseline), and the whole cell through ``lab.run`` with the profile's
arming, reading, merging and writing against the cell alone.

Each repeat runs the same cell twice, profiled (``lab.profile(steps=5, warmup=1)``) and not, in
alternating order. The cell trains 8 steps of a 3-layer MLP (256 -> 1024 -> 256, batch 64) under
DDP (gloo); a step is timed on the rank from ``zero_grad`` to the end of ``opt.step()``, and the
cell's value is the median of steps 3-7 (those the profile records) on rank 0.

    python benchmarks/bench_profile.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import distlab

SETUP = """
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batch = torch.randn(64, 256)
"""
TRAIN = """
import time, statistics
seconds = []
for _ in range(8):
    t0 = time.perf_counter()
    opt.zero_grad()
    model(batch).sum().backward()
    opt.step()
    seconds.append(time.perf_counter() - t0)
statistics.median(seconds[2:7])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    step: dict[str, list[float]] = {"profiled": [], "unprofiled (baseline)": []}
    cell: dict[str, list[float]] = {"profiled": [], "unprofiled (baseline)": []}
    folder = tempfile.mkdtemp(prefix="distlab-bench-profile-")
    with distlab.start(ranks=2) as lab:
        lab.run(SETUP, stream=False)
        lab.run(TRAIN, stream=False)  # warm: DDP's first iterations, torch's lazy imports
        with lab.profile(steps=1, path=os.path.join(folder, "warm.json")):
            lab.run(TRAIN, stream=False)  # the profiler's own first start on each rank
        for i in range(args.repeats):
            order = ["profiled", "unprofiled (baseline)"]
            for name in order if i % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                if name == "profiled":
                    with lab.profile(steps=5, warmup=1, path=os.path.join(folder, f"p{i}.json")) as prof:
                        value = lab.run(TRAIN, stream=False)[0]
                    assert [row["steps"] for row in prof.table()] == [5, 5], prof.text()
                else:
                    value = lab.run(TRAIN, stream=False)[0]
                cell[name].append(time.perf_counter() - t0)
                step[name].append(value)
        size = os.path.getsize(os.path.join(folder, "p0.json"))
    shutil.rmtree(folder, ignore_errors=True)
    print("| 2 ranks, gloo | a step, median (rank 0) | min-max | the whole cell (8 steps), median | min-max |")
    print("|---|---|---|---|---|")
    for name in step:
        s, c = step[name], cell[name]
        print(
            f"| {name} | {statistics.median(s) * 1e3:.2f} ms | {min(s) * 1e3:.2f}-{max(s) * 1e3:.2f} ms "
            f"| {statistics.median(c) * 1e3:.0f} ms | {min(c) * 1e3:.0f}-{max(c) * 1e3:.0f} ms |"
        )
    print(f"\nmerged trace of 2 ranks x 5 steps: {size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
