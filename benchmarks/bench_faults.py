"""Faults, timed: how fast a dead rank is named and the others released, how fast a world comes back,
and how far past its deadline a hung cell ends; against plain torch.distributed processes on the same
machine in the same run.

    python benchmarks/bench_faults.py [--repeats 5] [--ranks 2 4]

- death -> error: rank 1 SIGKILLs itself 0.3 s into a cell while the others wait for it in an
  all-reduce; the time from its death until the cell has failed on every rank. Baseline: the same
  program as plain processes (init_process_group over env://, 30 s timeout), the time until the last
  survivor's all-reduce raises.
- restart: ``lab.restart()`` after that death, to a world whose all-reduce works (target <= 10 s at 2).
- hang: a cell whose rank 0 calls an all-reduce that rank 1 never calls, ``timeout=2``; seconds past the
  deadline until the named error is raised and the group rebuilt. Plain torch waits its full timeout.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import distlab
from distlab import CellTimeout, RankError

PLAIN_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)
        print(f"died {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(1))
    except Exception:
        pass
    print(f"released {time.time()}", flush=True)
    os._exit(0)
    """
)


def plain_death_to_release(world: int) -> float:
    """Plain processes: seconds from rank 1's death until the last survivor's collective raised."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PLAIN_WORKER)
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, f.name], env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    os.unlink(f.name)
    died = float(next(line.split()[1] for line in outs[1].splitlines() if line.startswith("died")))
    released = [float(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("released")]
    return max(released) - died


DEATH = (
    "import os, signal, time\n"
    "if rank == 1:\n"
    "    time.sleep(0.3)\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "t = torch.ones(1)\n"
    "dist.all_reduce(t)\n"
)
HANG = "t = torch.ones(3, 5)\ndist.all_reduce(t)\nif rank == 0:\n    dist.all_reduce(torch.ones(7))\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print("| ranks | death -> all ranks failed, distlab (s) | death -> last survivor released, plain torch (s) "
          "| restart, distlab (s) | hang: past the 2 s deadline, distlab (s) |")
    print("|---|---|---|---|---|")
    for world in args.ranks:
        death, plain, restart, hang = [], [], [], []
        with distlab.start(ranks=world, timeout=60) as lab:
            for _ in range(args.repeats):
                plain.append(plain_death_to_release(world))
                t0 = time.monotonic()
                try:
                    lab.run(DEATH, stream=False)
                except RankError:
                    pass
                death.append(time.monotonic() - t0 - 0.3)
                t0 = time.monotonic()
                lab.restart()
                lab.run("t = torch.ones(1); dist.all_reduce(t)", stream=False)
                restart.append(time.monotonic() - t0)
                t0 = time.monotonic()
                try:
                    lab.run(HANG, timeout=2, stream=False)
                except CellTimeout:
                    pass
                hang.append(time.monotonic() - t0 - 2)

        def cell(values: list[float]) -> str:
            return f"{statistics.median(values):.2f} (max {max(values):.2f})"

        print(f"| {world} | {cell(death)} | {cell(plain)} | {cell(restart)} | {cell(hang)} |", flush=True)


if __name__ == "__main__":
    main()
