"""The notebook process's memory across start / stop cycles: RSS beside what tracemalloc counts.

tests/test_soak.py checks that 20 cycles of ``distlab.start``, cells and ``stop`` leave no process,
no file descriptor and (counted by tracemalloc) no Python object alive. It no longer bounds the
process's RSS: RSS also moves with the C allocator's arenas, which threads make or reuse as the
scheduler happens to run them, so the same code gives a different RSS on a loaded machine. This
measures both after each cycle, so a change in either shows as a trend (a leak) or as a step that
stays flat (an arena, a cache).

    python benchmarks/bench_soak_memory.py [--cycles 20] [--cells 10]
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc

import psutil

import distlab

CELL = "t = torch.ones(1); dist.all_reduce(t); t.item()"


def _cycle(cells: int) -> None:
    with distlab.start(ranks=2, timeout=60) as lab:
        for _ in range(cells):
            assert dict(lab.run(CELL, stream=False)) == {0: 2.0, 1: 2.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--cells", type=int, default=10)
    args = parser.parse_args()
    me = psutil.Process()
    _cycle(args.cells)  # warm-up: imports, caches and pools made once
    gc.collect()
    rss_start = me.memory_info().rss
    tracemalloc.start()
    print("| cycle | RSS (MiB) | RSS - after warm-up (MiB) | Python objects left alive (KiB) | fds |")
    print("|---|---|---|---|---|")
    try:
        for cycle in range(1, args.cycles + 1):
            _cycle(args.cells)
            gc.collect()
            rss = me.memory_info().rss
            alive, _peak = tracemalloc.get_traced_memory()
            print(f"| {cycle} | {rss / 2**20:.1f} | {(rss - rss_start) / 2**20:+.1f} | {alive / 2**10:.0f} "
                  f"| {me.num_fds()} |", flush=True)
    finally:
        tracemalloc.stop()


if __name__ == "__main__":
    main()
