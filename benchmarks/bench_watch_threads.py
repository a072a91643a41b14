"""Where a watched run's CPU goes: per thread on each rank, and per process on this host.

bench_telemetry.py says what watching costs in throughput; this says who pays. Two gloo ranks of
a real lab (each pinned to a core of its own) train one DDP MLP for a fixed time, unwatched then
watched at the defaults, twice each in turn. For each run it prints every rank thread's CPU per
step (from /proc/self/task: the training thread, gloo's, the telemetry publisher, ipyparallel's
IOPub) and the CPU that the notebook process (telemetry store, dashboard) and the controller used
meanwhile. Runs differ by a few percent in step time on this machine; compare the threads, not the
steps/s of a single pair.

    python benchmarks/bench_watch_threads.py [--width 1024] [--seconds 15] [--no-dashboard]
"""

from __future__ import annotations

import argparse
import time

import psutil

import distlab

_RANK_CODE = r"""
import os, threading, time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
os.sched_setaffinity(0, {rank % os.cpu_count()})

def _thread_cpu():
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return out

torch.manual_seed(0)
w = WIDTH
model = DDP(torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.ReLU(), torch.nn.Linear(2 * w, w),
                                torch.nn.ReLU(), torch.nn.Linear(w, 10)))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(64, w), torch.randint(0, 10, (64,))
watch = distlab.watch(model) if WATCHED else None

def _step():
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    distlab.log(loss=loss)

for _ in range(3):
    _step()
# Both ranks must make the same number of steps: rank 0's estimate for SECONDS decides.
t0 = time.perf_counter()
for _ in range(10):
    _step()
steps = torch.tensor([max(10, round(SECONDS * 10 / (time.perf_counter() - t0)))])
dist.broadcast(steps, 0)
n = int(steps.item())
names = {t.native_id: t.name for t in threading.enumerate()}
before = _thread_cpu()
t0 = time.perf_counter()
for _ in range(n):
    _step()
elapsed = time.perf_counter() - t0
after = _thread_cpu()
if watch is not None:
    watch.close()
os.sched_setaffinity(0, range(os.cpu_count()))
per_thread = {}
for tid, (name, cpu) in after.items():
    label = names.get(tid, name)
    per_thread[label] = per_thread.get(label, 0.0) + (cpu - before.get(tid, (name, 0.0))[1]) * 1e3 / n
(n / elapsed, per_thread)
"""


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024, help="MLP width w: 4w^2 parameters (1024: 4.2M)")
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--no-dashboard", action="store_true")
    args = parser.parse_args()
    me = psutil.Process()
    with distlab.start(ranks=2, timeout=120) as lab:
        if not args.no_dashboard:
            lab.dashboard()
        controller = [p for p in me.children(recursive=True) if "ipcontroller" in " ".join(p.cmdline())
                      or "ipyparallel.controller" in " ".join(p.cmdline())]
        print(f"width {args.width}, {args.seconds} s per run, dashboard {'off' if args.no_dashboard else 'on'}")
        print("| run | steps/s | rank threads, CPU ms per step (rank 0 / rank 1) | notebook process CPU | controller CPU |")
        print("|---|---|---|---|---|")
        for watched in (False, True, False, True):
            lab.push(WIDTH=args.width, SECONDS=args.seconds, WATCHED=watched)
            mine, ctl = _cpu_s(me), sum(_cpu_s(p) for p in controller)
            t0 = time.perf_counter()
            results = lab.run(_RANK_CODE, stream=False, timeout=600)
            wall = time.perf_counter() - t0
            mine, ctl = _cpu_s(me) - mine, sum(_cpu_s(p) for p in controller) - ctl
            threads = sorted({name for _, per in results.values() for name in per})
            cells = ", ".join(
                f"{name} {' / '.join(f'{results[r][1].get(name, 0.0):.2f}' for r in sorted(results))}"
                for name in threads
                if any(results[r][1].get(name, 0.0) >= 0.01 for r in results)
            )
            print(f"| {'watched' if watched else 'unwatched'} | {results[0][0]:.1f} | {cells} "
                  f"| {1e3 * mine / wall:.0f} ms/s | {1e3 * ctl / wall:.0f} ms/s |", flush=True)


if __name__ == "__main__":
    main()
