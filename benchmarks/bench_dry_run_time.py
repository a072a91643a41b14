"""How long the scale dry run takes at 1,024 GPUs: deep stages read from two shallow runs (what
``scale.dry_run`` does) against every stage run whole (the baseline), in the same rounds.

    python benchmarks/bench_dry_run_time.py --rounds 2 [--spin]

Each round runs each plan both ways, in turn, each as ``scale.dry_run`` does: a fresh
``python -m distlab.rank.dryrun``-like process (its imports counted). ``--spin`` keeps a process
spinning on one core for the whole run (a busy machine). The table shows every round's seconds,
and whether the two reports were equal (they must be: ``distlab/rank/dryrun_depth.py``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time

from distlab import scale

PLANS = {
    "Llama 3 8B, TP 8 x FSDP 128": scale.Plan(
        model="llama3-8b", gpus=1024, tp=8, seq_len=8192, global_batch_tokens=4 * 2**20),
    "Llama 3 70B, TP 8 x PP 4 x FSDP 32, full checkpointing": scale.Plan(
        model="llama3-70b", gpus=1024, tp=8, pp=4, seq_len=8192, global_batch_tokens=2**22,
        checkpointing="full"),
    "Llama 3.1 405B, TP 8 x PP 16 x FSDP 8 (1F1B), full checkpointing": scale.Plan(
        model="llama3-405b", gpus=1024, tp=8, pp=16, seq_len=8192, global_batch_tokens=2**22,
        schedule="1f1b", checkpointing="full"),
}

_RUN = """
import json, sys
from distlab.rank import dryrun
if sys.argv[2] == "whole":
    dryrun.DEEP = 10**9
print(json.dumps(dryrun.dry_run(json.loads(sys.argv[1]))["kinds"]))
"""


def _spin() -> None:
    while True:
        pass


def _run(plan: scale.Plan, how: str) -> tuple[float, object]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _RUN, json.dumps(plan.to_json()), how],
                          capture_output=True, text=True, timeout=1800, check=True)
    return time.perf_counter() - start, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spin", action="store_true", help="a process spinning on one core throughout")
    args = parser.parse_args()
    spinner = multiprocessing.Process(target=_spin, daemon=True) if args.spin else None
    if spinner is not None:
        spinner.start()
    seconds: dict[tuple[str, str], list[float]] = {}
    equal: dict[str, bool] = {}
    try:
        for _ in range(args.rounds):
            for name, plan in PLANS.items():
                reports = {}
                for how in ("shallow", "whole"):
                    took, reports[how] = _run(plan, how)
                    seconds.setdefault((name, how), []).append(took)
                equal[name] = equal.get(name, True) and reports["shallow"] == reports["whole"]
    finally:
        if spinner is not None:
            spinner.terminate()
            spinner.join()
    print(f"| plan, 1,024 GPUs{' (a core spinning)' if args.spin else ''} | read from 4 and 5 blocks (s) "
          "| every stage whole (s) | reports equal |")
    print("|---|---|---|---|")
    for name in PLANS:
        shallow, whole = (", ".join(f"{s:.1f}" for s in seconds[(name, how)]) for how in ("shallow", "whole"))
        print(f"| {name} | {shallow} | {whole} | {'yes' if equal[name] else 'NO'} |")


if __name__ == "__main__":
    main()
