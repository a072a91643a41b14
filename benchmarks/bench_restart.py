"""A restart with spare engines against one without, in one run; and what an idle spare costs.

    python benchmarks/bench_restart.py [--repeats 3] [--restarts 3] [--ranks 2 4]

One Python process, the warm-rank template started and ready first (as ``%load_ext distlab`` leaves
it once a person has read the first cell). For each world size, labs with spares (the default: one a
rank) and without (``spares=0``) alternate in every repeat; each lab is restarted ``--restarts``
times, a cell run between restarts, and (with spares) the new spares given time to register first,
as they have in a notebook where a person reads a cell's output before restarting. Timed:

- to a working group: ``lab.timings["restart_s"]``, from the call to the new world's process group
  formed and its first all-reduce done (what a restart's user waits for before the next cell);
- the call: ``lab.restart()`` returning, the old world's processes gone too.

Memory: each idle spare's RSS, PSS and USS (psutil), next to an idle rank's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil

import distlab
from distlab.cluster import warm
from distlab.cluster.processes import wait_for

CELL = "t = torch.ones(1); dist.all_reduce(t); int(t.item())"


def _spares_registered(lab) -> bool:
    ranks = {row.engine_id for row in lab.table}
    return len(set(lab.processes.client.ids) - ranks - lab.processes.retired) >= lab.config.spare_count


def _memory_mb(pids) -> dict[str, float]:
    rows = [psutil.Process(pid).memory_full_info() for pid in pids]
    return {k: statistics.median(getattr(r, k) for r in rows) / 2**20 for k in ("rss", "pss", "uss")}


def measure(ranks: int, spares: int | None, restarts: int) -> tuple[list[float], list[float], dict]:
    to_group, calls, memory = [], [], {}
    with distlab.start(ranks=ranks, spares=spares) as lab:
        for i in range(restarts):
            if not wait_for(lambda: _spares_registered(lab), 60):
                raise SystemExit("the spares did not register within 60 s")
            if i == 0 and lab.config.spare_count:
                memory["spare"] = _memory_mb(lab.processes.spares.pids())
                memory["rank"] = _memory_mb(row.pid for row in lab.table)
            t = time.perf_counter()
            lab.restart()
            calls.append(time.perf_counter() - t)
            to_group.append(lab.timings["restart_s"])
            assert set(lab.run(CELL, stream=False).values()) == {ranks}
    return to_group, calls, memory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    warm.prewarm()
    warm.current(os.environ).wait_ready()
    rows = []
    for ranks in args.ranks:
        found: dict[str, tuple[list[float], list[float]]] = {"spares": ([], []), "none": ([], [])}
        memory: dict = {}
        for _ in range(args.repeats):
            for name, spares in (("spares", None), ("none", 0)):
                group, call, mem = measure(ranks, spares, args.restarts)
                found[name][0].extend(group)
                found[name][1].extend(call)
                memory = memory or mem
        base = statistics.median(found["none"][0])
        for name, label in (("none", "without spares (`spares=0`)"), ("spares", "with spares (default)")):
            group, call = found[name]
            rows.append(
                f"| {ranks} | {label} | {statistics.median(group):.3f} | {statistics.median(group) / base:.2f}x "
                f"| {statistics.median(call):.3f} | {', '.join(f'{g:.2f}' for g in group)} |"
            )
        print(f"idle spare at {ranks} ranks (MiB, medians): {memory.get('spare')}; idle rank: {memory.get('rank')}",
              flush=True)
    print("| ranks | lab | to a working group (median s) | vs without | the call (median s) | runs (to a group) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
