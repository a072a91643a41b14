"""How long ``scale.dry_run`` takes for two plans at 1,024 GPUs, and the optimizer state it counts.

    python benchmarks/bench_dry_run_time.py --rounds 2

Each round dry-runs each plan once (the plans in turn); the table shows every round's seconds and
the optimizer state's bytes, which a change of speed must leave as they were. To compare two
versions of the dry run, run this at each (benchmarks/RESULTS.md says which commits).
"""

from __future__ import annotations

import argparse
import time

from distlab import scale

PLANS = {
    "Llama 3 8B, 1,024 GPUs, TP 8 x FSDP 128": scale.Plan(
        model="llama3-8b", gpus=1024, tp=8, seq_len=8192, global_batch_tokens=4 * 2**20),
    "Llama 3 70B, 1,024 GPUs, TP 8 x PP 4 x FSDP 32": scale.Plan(
        model="llama3-70b", gpus=1024, tp=8, pp=4, seq_len=8192, global_batch_tokens=2**22),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in PLANS}
    optimizer: dict[str, set[int]] = {name: set() for name in PLANS}
    for _ in range(args.rounds):
        for name, plan in PLANS.items():
            start = time.perf_counter()
            report = scale.dry_run(plan)
            seconds[name].append(time.perf_counter() - start)
            optimizer[name].add(int(report.kinds[0].memory["optimizer"]))
    print("| plan (scale.dry_run) | seconds, each round | optimizer state (bytes) |")
    print("|---|---|---|")
    for name in PLANS:
        rounds = ", ".join(f"{s:.1f}" for s in seconds[name])
        print(f"| {name} | {rounds} | {', '.join(f'{b:,}' for b in sorted(optimizer[name]))} |")


if __name__ == "__main__":
    main()
