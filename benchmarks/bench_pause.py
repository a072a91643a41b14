"""What an armed breakpoint that is never reached costs a training step (``lab.pause``: every op of the
cell passes through its dispatch mode, which counts the collectives), against the same steps unarmed.

    python benchmarks/bench_pause.py [--rounds 5] [--steps 20]

One lab of 2 gloo ranks. Each round runs every step kind twice, unarmed and armed (at a collective
past the cell's last), in alternating order, so the machine's drift falls on both alike. A round's
figure is the median step of ``--steps`` (after 3 unmeasured), the slower rank's; the table shows the
median over rounds and the spread of the unarmed rounds (what the machine alone moves a step by).
The step kinds and their cells are ``bench_collective_check.py``'s: DDP, FSDP2 and tensor parallelism.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import distlab

sys.path.insert(0, os.path.dirname(__file__))
from bench_collective_check import SETUP, STEPS  # the same cells, measured the same way


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    step_code = STEPS.format(steps=args.steps)
    times: dict[tuple[str, bool], list[float]] = {(k, a): [] for k in SETUP for a in (False, True)}
    with distlab.start(ranks=2) as lab:
        for kind, setup in SETUP.items():
            lab.run(setup.replace("model", f"model_{kind}") + "\npass\n", stream=False)
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for kind in SETUP:
                for armed in order:
                    if armed:
                        lab.pause(at=10**9)  # armed, never reached
                    got = lab.run(step_code.replace("model", f"model_{kind}"), stream=False)
                    times[kind, armed].append(float(got[0]))
    print(f"| step (2 gloo ranks, {args.steps} steps a round, {args.rounds} rounds) | unarmed (ms) | "
          "armed, not reached (ms) | armed / unarmed | rounds' spread unarmed (ms) |")
    print("|---|---|---|---|---|")
    for kind in SETUP:
        off, on = times[kind, False], times[kind, True]
        print(f"| {kind} | {statistics.median(off) * 1e3:.2f} | {statistics.median(on) * 1e3:.2f} | "
              f"{statistics.median(on) / statistics.median(off):.2f} | {min(off) * 1e3:.2f}-{max(off) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
