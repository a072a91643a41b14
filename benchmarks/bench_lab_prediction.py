"""The predictor checked on the lab itself: ``scale.calibrate`` measures the lab's compute and links,
``scale.predict`` says what each plan's step takes and holds, ``scale.measure`` runs the plan's code on
the lab's ranks, and the table puts them side by side with the error.

Nothing of the plans checked goes into the calibration: it times a matmul, the calibration model
whole and alone on every rank, copies and all-reduces. The plans then split that model across the
ranks (FSDP, DDP, tensor parallelism, HSDP and FSDP x TP at 4 ranks), so what is checked is the
dry run's counts (FLOPs, collectives, memory) and the predictor's model of time and overlap.

    python benchmarks/bench_lab_prediction.py [--ranks 2] [--steps 5] [--nodes N --link 1gbit]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import distlab
from distlab import scale

TOKENS, BATCH = 256, 4  # each micro-batch: 4 sequences of 256 tokens


def plans(ranks: int, accumulate: int) -> dict[str, scale.Plan]:
    common: dict[str, Any] = {"model": scale.CALIBRATION_MODEL, "gpus": ranks, "seq_len": TOKENS,
                              "micro_batch_size": BATCH, "precision": "fp32"}
    out = {
        f"FSDP {ranks}": scale.Plan(dp="fsdp", global_batch_tokens=TOKENS * BATCH * ranks * accumulate, **common),
        f"DDP {ranks}": scale.Plan(dp="ddp", global_batch_tokens=TOKENS * BATCH * ranks * accumulate, **common),
        "TP 2" + (f" x FSDP {ranks // 2}" if ranks > 2 else ""): scale.Plan(
            tp=2, global_batch_tokens=TOKENS * BATCH * ranks // 2 * accumulate, **common),
    }
    if ranks >= 4:
        out[f"HSDP 2 x {ranks // 2}"] = scale.Plan(dp="hsdp", shard=2, global_batch_tokens=TOKENS * BATCH * ranks
                                                   * accumulate, **common)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--link", default=None)
    args = parser.parse_args()
    extra = {"nodes": args.nodes, "link": args.link} if args.nodes else {}
    lab = distlab.start(args.ranks, **extra)
    try:
        t0 = time.perf_counter()
        cal = scale.calibrate(lab)
        print(f"calibrated in {time.perf_counter() - t0:.1f} s: {cal}\n")
        print("| plan | predicted step (calibrated before) | error | predicted step (compute timed beside the steps) "
              "| measured step (min-max) | error | predicted peak | measured peak | error | where the predicted time "
              "goes |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, plan in plans(args.ranks, args.accumulate).items():
            report = scale.dry_run(plan)
            before = scale.predict(plan, hardware=cal.hardware, network=cal.network, report=report)
            run = scale.measure(lab, plan, steps=args.steps, calibration=cal)
            assert run.calibration is not None
            pred = scale.predict(plan, hardware=run.calibration.hardware, network=cal.network, report=report)
            low, high = run.spread
            before_err = before.step_time_s / run.step_time_s - 1
            time_err = pred.step_time_s / run.step_time_s - 1
            mem_err = pred.memory_per_gpu_bytes / run.memory["peak"] - 1
            where = ", ".join(f"{k} {1e3 * v:.0f}" for k, v in pred.breakdown.items() if v > 5e-4)
            print(f"| {name} | {1e3 * before.step_time_s:.0f} ms | {100 * before_err:+.1f}% | "
                  f"{1e3 * pred.step_time_s:.0f} ms | {1e3 * run.step_time_s:.0f} ms ({1e3 * low:.0f}-"
                  f"{1e3 * high:.0f}) | {100 * time_err:+.1f}% | {pred.memory_per_gpu_bytes / 2**20:.2f} MiB | "
                  f"{run.memory['peak'] / 2**20:.2f} MiB | {100 * mem_err:+.1f}% | {where} (ms) |")
    finally:
        lab.stop()


if __name__ == "__main__":
    main()
