"""A new lab's first training step: how long the first DDP cell takes, and the start before it.

    python benchmarks/bench_first_step.py [--repeats 5] [--ranks 2 4]

One Python process; the warm-rank template started and ready first (as ``%load_ext distlab`` leaves
it once a person has read the first cell). Each repeat starts a lab and runs the cell below once:
a DDP model, an optimizer, one step. torch imports TorchDynamo at a process's first optimizer or DDP
model; a template that imported it (``rank/warm_template.py``) forks ranks that have it already.
Run it at two commits to compare (a worktree of each, ``PYTHONPATH`` set to it), alternating:

    for i in 1 2 3; do for tree in /tmp/before /tmp/after; do
      PYTHONPATH=$tree .venv/bin/python benchmarks/bench_first_step.py --repeats 1; done; done

Timed: ``lab.timings["ready_s"]`` (the start) and the first cell, wall clock in the notebook.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import distlab
from distlab.cluster import warm

CELL = """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(32, 64)).pow(2).mean().backward()
opt.step()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    warm.current(os.environ).wait_ready()
    print(f"distlab at {os.path.dirname(distlab.__file__)}")
    print("| ranks | start (median s) | first DDP cell (median s) | first cells (s) |")
    print("|---|---|---|---|")
    for ranks in args.ranks:
        starts, cells = [], []
        for _ in range(args.repeats):
            with distlab.start(ranks=ranks) as lab:
                starts.append(lab.timings["ready_s"])
                t0 = time.perf_counter()
                lab.run(CELL, stream=False)
                cells.append(time.perf_counter() - t0)
        print(f"| {ranks} | {statistics.median(starts):.2f} | {statistics.median(cells):.2f} | "
              f"{', '.join(f'{c:.2f}' for c in cells)} |")


if __name__ == "__main__":
    main()
