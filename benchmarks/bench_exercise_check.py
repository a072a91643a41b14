"""Four checks of the ring all-reduce exercise, as a learner makes them: a right answer, a wrong
one, one that deadlocks (stopped at its 5 s deadline), the right one again. Each check grades the
learner's code in worlds of 2, 3 and 4 ranks of the grader's own (a wrong answer stops at the
first case it fails).

Two ways, interleaved within each repeat so that drift hits both alike:

- ``kept``: what distlab does. The grader's worlds are forked from the warm template at the first
  check that needs them and kept; later checks start no engine (a deadlock's world is restarted
  on spares only when a rank had to be killed).
- ``cold``, the baseline: what it did before warm ranks. Every check starts its three worlds from
  fresh processes (``DISTLAB_WARM=0``), and they are stopped after the check.

    python benchmarks/bench_exercise_check.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import distlab
from distlab.exercises import catalog, grading

RIGHT = catalog.get("ring-allreduce").solution()
WRONG = """
def ring_all_reduce(tensor):
    dist.all_reduce(tensor)
"""
DEADLOCK = """
def ring_all_reduce(tensor):
    for step in range(world_size - 1):
        dist.recv(tensor, (rank - 1) % world_size)
        dist.send(tensor, (rank + 1) % world_size)
"""
CHECKS = (("right", RIGHT, None), ("wrong", WRONG, None), ("deadlock", DEADLOCK, 5.0), ("right, again", RIGHT, None))


def _checks(lab: distlab.Lab, cold: bool) -> dict[str, float]:
    seconds = {}
    for name, code, timeout in CHECKS:
        lab.run(code, stream=False)
        t0 = time.perf_counter()
        result = grading.check("ring-allreduce", lab, seed=11, case_timeout_s=timeout, record=False)
        seconds[name] = time.perf_counter() - t0
        assert result.passed == name.startswith("right"), result.feedback
        if cold:  # the next check starts its worlds again
            for world in lab.companions.values():
                world.stop()
            lab.companions.clear()
    return seconds


def _once(cold: bool) -> dict[str, float]:
    before = os.environ.get("DISTLAB_WARM")
    if cold:
        os.environ["DISTLAB_WARM"] = "0"
    try:
        with distlab.start(ranks=2) as lab:
            return _checks(lab, cold)
    finally:
        if before is None:
            os.environ.pop("DISTLAB_WARM", None)
        else:
            os.environ["DISTLAB_WARM"] = before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "kept": []}
    for _ in range(args.repeats):
        for way in ("cold", "kept"):
            runs[way].append(_once(way == "cold"))
            print(way, {k: round(v, 2) for k, v in runs[way][-1].items()}, flush=True)
    print(f"\nmedians of {args.repeats}")
    print("| check | a world started per check, cold (baseline) | worlds kept, warm ranks | ratio |")
    print("|---|---|---|---|")
    for name, _, _ in (*CHECKS, ("all four", None, None)):
        def med(way: str, name: str = name) -> float:
            if name == "all four":
                return statistics.median(sum(run.values()) for run in runs[way])
            return statistics.median(run[name] for run in runs[way])

        print(f"| {name} | {med('cold'):.2f} s | {med('kept'):.2f} s | {med('kept') / med('cold'):.2f}x |")


if __name__ == "__main__":
    main()
