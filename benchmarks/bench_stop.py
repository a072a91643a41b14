"""Time to stop and restart a lab, against ipyparallel's own stop of the same cluster, in one run.

- stop: ``lab.stop()``, from the call until every engine, nanny and the controller is gone.
  Baseline: an identical lab stopped by ipyparallel alone (``Cluster.stop_cluster_sync()``, which
  SIGTERMs the engines and waits for them launcher by launcher), then distlab's own check that
  nothing is left (which finds nothing to do, or kills what is).
- restart: ``lab.restart()`` to a world whose all-reduce works (engines stopped, new ones started).

Labs are started in alternation, so both sides see the same machine; the table shows medians.

    python benchmarks/bench_stop.py [--repeats 5] [--ranks 2 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import distlab

ALL_REDUCE = "t = torch.ones(1); dist.all_reduce(t); t.item()"


def _ipyparallel_stop(lab: distlab.Lab) -> float:
    """Seconds for ipyparallel's own stop; what it leaves is then cleaned up (untimed)."""
    cluster, pids, pgids = lab.processes.cluster, lab.world.local_pids(), lab.processes.guard.pgids()
    lab.processes.client.close()
    t0 = time.perf_counter()
    cluster.stop_cluster_sync()
    seconds = time.perf_counter() - t0
    lab.processes.cluster = lab.processes.client = None
    lab.processes.guard.end_all(pgids, pids)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print("| ranks | ipyparallel stop (s) | lab.stop() (s) | ratio | lab.restart() (s) |")
    print("|---|---|---|---|---|")
    for n in args.ranks:
        theirs, ours, restarts = [], [], []
        for _ in range(args.repeats):
            lab = distlab.start(ranks=n, timeout=60)
            lab.run(ALL_REDUCE, stream=False)
            theirs.append(_ipyparallel_stop(lab))
            lab = distlab.start(ranks=n, timeout=60)
            lab.run(ALL_REDUCE, stream=False)
            t0 = time.perf_counter()
            lab.restart()
            restarts.append(time.perf_counter() - t0)
            assert lab.run(ALL_REDUCE, stream=False) == {r: float(n) for r in range(n)}
            t0 = time.perf_counter()
            lab.stop()
            ours.append(time.perf_counter() - t0)
        a, b = statistics.median(theirs), statistics.median(ours)
        print(f"| {n} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {statistics.median(restarts):.2f} |", flush=True)


if __name__ == "__main__":
    main()
