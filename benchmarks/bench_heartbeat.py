"""The hub's heartbeat period against a warm lab's start and restart, in one process.

    python benchmarks/bench_heartbeat.py [--repeats 8] [--ranks 2]

ipyparallel's hub finishes an engine's registration once it has seen the engine's heartbeat, so the
period bounds how soon a start or a restart is ready. The template is made ready first (as it is once
``%load_ext distlab`` has run a moment); then, alternating which goes first, a lab is started
(``distlab.start`` to its first all-reduce) and restarted (``lab.restart()`` to the new world's) with
the period at 250 ms (20 misses) and at 100 ms (50 misses), and medians are printed as a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import distlab
from distlab.cluster import launch, warm

SETTINGS = {250: 20, 100: 50}  # period (ms): misses, 5 s either way


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    warm.prewarm()
    warm.current(os.environ).wait_ready()
    starts: dict[int, list[float]] = {period: [] for period in SETTINGS}
    restarts: dict[int, list[float]] = {period: [] for period in SETTINGS}
    for repeat in range(args.repeats):
        order = list(SETTINGS) if repeat % 2 == 0 else list(reversed(SETTINGS))
        for period in order:
            launch.HEARTBEAT_MS, launch.HEARTBEAT_MISSES = period, SETTINGS[period]
            t0 = time.perf_counter()
            lab = distlab.start(ranks=args.ranks)
            t1 = time.perf_counter()
            try:
                lab.restart()
                t2 = time.perf_counter()
            finally:
                lab.stop()
            starts[period].append(t1 - t0)
            restarts[period].append(t2 - t1)
    print("| heartbeat | start (median s) | runs | restart (median s) | runs |")
    print("|---|---|---|---|---|")
    for period, misses in SETTINGS.items():
        s, r = starts[period], restarts[period]
        print(f"| {period} ms, {misses} misses | {statistics.median(s):.2f} | {', '.join(f'{x:.2f}' for x in s)} "
              f"| {statistics.median(r):.2f} | {', '.join(f'{x:.2f}' for x in r)} |")


if __name__ == "__main__":
    main()
