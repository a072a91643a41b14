"""Round trip of an empty %%ddp cell vs raw ipyparallel ``execute`` on the same engines.

The baseline is the cheapest path ipyparallel offers (``DirectView.execute("pass", block=True)``);
distlab's number is the whole ``%%ddp`` magic in a real IPython shell: argument parsing, one
apply per rank, output streaming and error checks included.
Calls are interleaved (A, B, A, B, ...) so drift hits both alike; the table shows p50 and p90.

    python benchmarks/bench_roundtrip.py [--calls 200] [--ranks 2 4] [--backend auto|gloo|nccl]
"""

from __future__ import annotations

import argparse
import statistics
import time

from IPython.testing.globalipapp import start_ipython

import distlab.front.magics


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = parser.parse_args()
    ip = start_ipython()
    ip.run_line_magic("load_ext", "distlab")
    magics = distlab.front.magics._registered[id(ip)]
    print("| ranks | backend | ipyparallel execute p50 (ms) | %%ddp p50 (ms) | ratio p50 | execute p90 (ms) | %%ddp p90 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for n in args.ranks:
        ip.run_line_magic("dist", f"start -n {n} --backend {args.backend}")
        lab = magics.lab
        view = lab.processes.client.direct_view([row.engine_id for row in lab.table])
        raw, ours = [], []
        for i in range(args.calls + 10):
            t0 = time.perf_counter()
            view.execute("pass", block=True)
            t1 = time.perf_counter()
            ip.run_cell_magic("ddp", "", "pass")
            t2 = time.perf_counter()
            if i >= 10:  # warm-up
                raw.append((t1 - t0) * 1e3)
                ours.append((t2 - t1) * 1e3)
        a, b = statistics.median(raw), statistics.median(ours)
        where = f"{lab.backend} ({lab.table[0].device})"
        print(f"| {n} | {where} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {_pct(raw, 90):.2f} | {_pct(ours, 90):.2f} |",
              flush=True)
        ip.run_line_magic("dist", "stop")


if __name__ == "__main__":
    main()
