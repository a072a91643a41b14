"""Time from a watched cell's first telemetry to its dashboard on screen, in a fresh kernel.

Each run starts a fresh Jupyter kernel, `%dist start -n 2`, waits `--think` seconds (0: "Run
All", the watched cell comes at once), then runs a DDP cell under `distlab.watch`. Rank 0 notes
the wall-clock time its first step was logged (its first publish goes out then); the dashboard is
on screen when the kernel sends the cell's first display_data. Same machine, same clock. Baseline:
the same kernel with the dashboard's background import turned off (`autoshow.PREWARM = False`),
runs interleaved; medians.

    python benchmarks/bench_first_dashboard.py [--repeats 3] [--think 0 3]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

from jupyter_client.manager import start_new_kernel

CELL = """%%ddp
import time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(torch.nn.Linear(32, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
first = None
with distlab.watch(model):
    for step in range(40):
        opt.zero_grad()
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        distlab.log(loss=0.0)
        first = first or time.time()
        time.sleep(0.05)
if rank == 0:
    print("FIRST", first)
"""


def _when(msg: dict) -> float:
    date = msg["header"]["date"]
    if isinstance(date, str):
        date = datetime.datetime.fromisoformat(date)
    return date.timestamp()


def one_run(prewarm: bool, think_s: float) -> float:
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        setup = "%load_ext distlab\nimport distlab.dashboard.autoshow as _a\n"
        if not prewarm:
            setup += "_a.PREWARM = False\n"
        kc.execute_interactive(setup + "%dist start -n 2", timeout=180)
        time.sleep(think_s)
        messages: list[dict] = []
        kc.execute_interactive(CELL, timeout=180, output_hook=messages.append)
        first = next(
            float(line.split()[-1])
            for m in messages if m["msg_type"] == "stream"
            for line in m["content"]["text"].splitlines() if "FIRST" in line
        )
        shown = next(_when(m) for m in messages if m["msg_type"] == "display_data")
        return shown - first
    finally:
        km.shutdown_kernel(now=False)
        kc.stop_channels()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--think", type=float, nargs="+", default=[0.0, 3.0])
    args = parser.parse_args()
    print("| seconds between start and the watched cell | dashboard import | first telemetry -> dashboard shown (median s) | runs |")
    print("|---|---|---|---|")
    for think in args.think:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for prewarm in (False, True):
                times[prewarm].append(one_run(prewarm, think))
        for prewarm in (False, True):
            runs = ", ".join(f"{t:.2f}" for t in times[prewarm])
            what = "in the background at start" if prewarm else "when first needed (before)"
            print(f"| {think:g} | {what} | {statistics.median(times[prewarm]):.2f} | {runs} |")


if __name__ == "__main__":
    main()
