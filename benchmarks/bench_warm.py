"""Warm ranks against cold ones and torchrun: time to ready, and a restart, in one run.

    python benchmarks/bench_warm.py [--repeats 5] [--ranks 2 4] [--nodes N]

Rows, interleaved in every repeat, each a fresh Python process:
- torchrun: ``torchrun --standalone`` from its launch to its workers' first all-reduce (what
  bench_startup.py times: interpreter start-up and ``import torch`` included);
- cold: ``DISTLAB_WARM=0``, engines started as fresh processes: from the process's launch to
  ``distlab.start``'s first all-reduce, as bench_startup.py times distlab;
- warm: ``%load_ext distlab`` has started the template (``warm.prewarm()``) and it is ready, as it
  is once a person has read the first cell: from calling ``distlab.start`` to its first all-reduce;
- warm, at once: the template started at the same moment as the lab (a "Run All"), from launch.
A restart (``lab.restart()``, to the new world's first all-reduce) is timed in the cold and warm rows.
``--nodes N``: the labs on N emulated nodes (root): warm engines are forked into their node's
namespace, cold ones start there under ``ip netns exec``; torchrun's row stays on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

DISTLAB = textwrap.dedent(
    """
    import json, os, sys, time
    launched = float(sys.argv[3])
    import distlab
    from distlab.cluster import warm
    if sys.argv[2] == "warm":
        warm.prewarm()
        warm.current(os.environ).wait_ready()
    asked = time.time()
    lab = distlab.start(ranks=int(sys.argv[1]), nodes=int(sys.argv[4]) or None)
    ready = time.time()
    t = time.perf_counter()
    lab.restart()
    restart = time.perf_counter() - t
    print(json.dumps({"from_launch": ready - launched, "from_start": ready - asked, "restart": restart}))
    lab.stop()
    """
)

TORCHRUN_WORKER = textwrap.dedent(
    """
    import json, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    ready = time.time()
    if dist.get_rank() == 0:
        print(json.dumps({"ready_at": ready}))
    dist.destroy_process_group()
    """
)


def _distlab(ranks: int, mode: str, nodes: int) -> dict[str, float]:
    env = {**os.environ, "DISTLAB_WARM": "0" if mode == "cold" else "1"}
    out = subprocess.run(
        [sys.executable, "-c", DISTLAB, str(ranks), mode, repr(time.time()), str(nodes)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _torchrun(ranks: int, script: Path) -> float:
    launched = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    ready: float = json.loads(out.stdout.strip().splitlines()[-1])["ready_at"]
    return ready - launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--nodes", type=int, default=0, help="emulated nodes for the labs (0: none)")
    args = parser.parse_args()
    rows: dict[tuple[int, str], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(TORCHRUN_WORKER)
        for _ in range(args.repeats):
            for ranks in args.ranks:
                rows.setdefault((ranks, "torchrun"), {}).setdefault("ready", []).append(_torchrun(ranks, script))
                for mode in ("cold", "warm", "warm, at once"):
                    got = _distlab(ranks, "warm" if mode == "warm" else mode, args.nodes)
                    cell = rows.setdefault((ranks, mode), {})
                    cell.setdefault("ready", []).append(got["from_start"] if mode == "warm" else got["from_launch"])
                    cell.setdefault("restart", []).append(got["restart"])
    where = f" on {args.nodes} nodes" if args.nodes else ""
    print(f"| ranks{where} | how | ready (median s) | vs torchrun | restart (median s) | runs (ready) |")
    print("|---|---|---|---|---|---|")
    for ranks in args.ranks:
        base = statistics.median(rows[(ranks, "torchrun")]["ready"])
        for mode in ("torchrun", "cold", "warm, at once", "warm"):
            cell = rows[(ranks, mode)]
            ready = statistics.median(cell["ready"])
            restart = f"{statistics.median(cell['restart']):.2f}" if "restart" in cell else "-"
            runs = ", ".join(f"{v:.2f}" for v in cell["ready"])
            print(f"| {ranks} | {mode} | {ready:.2f} | {ready / base:.2f}x | {restart} | {runs} |")


if __name__ == "__main__":
    main()
