"""The predictor against runs that were really trained and published: each row's plan dry-run here
(``scale.dry_run``: the real torch code at the run's world size, in one process), predicted
(``scale.predict``) on the run's machine, and put next to what was published, with the error.

One number of the model is fitted per part, not counted: its ``Hardware.efficiency``, the fraction of
its kernels' own time (each kind at its published rate, ``Hardware.kernel_rates``) that a step's
compute reaches. ``--fit`` refits each part's on its row marked "fit" and prints it: the H100 SXM's
on NVIDIA's Megatron-Bridge Llama 3 8B row, torchtitan's 500 W H100s' on torchtitan's Llama 3.1 8B on
128 GPUs; every other row then tests the model. Memory is compared with what torchtitan published
(its maximum across GPUs of the memory the job held); the Llama 3 paper and NVIDIA give none.

    python benchmarks/bench_published_runs.py [--fit] [--only SUBSTRING] [--cache FILE]

``--cache``: the dry runs' reports are kept in FILE (pickled, by plan) and read back on the next run,
so that a change to the predictor alone is tried on every row without dry-running them again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distlab import scale
from distlab.errors import LabUsageError
from distlab.scale import prediction as model

TITAN = ("torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024; H100 96 GB HBM2e at 2.4 TB/s and 500 W, "
         "400 Gb/s RDMA per GPU)")
LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4 (H100 80 GB at 700 W, RoCE 400 Gb/s per GPU)"
BRIDGE = ("NVIDIA Megatron-Bridge performance summary (docs/performance-summary-archive.md at 067f987; "
          "docs.nvidia.com/nemo/megatron-bridge), DGX-H100, {release}")
NEMO = "NVIDIA NeMo performance summary, NeMo 24.07 (NVIDIA/NeMo docs/source/performance/performance_summary.md at 9c5c5e9), DGX-H100"


def _megatron(model: str, gpus: int, gbs: int, tp: int, pp: int, cp: int, vp: int) -> dict[str, Any]:
    """A Megatron-Bridge/NeMo row's plan: DDP with the distributed optimizer, micro-batch 1, seq 8,192,
    Transformer Engine's fused kernels."""
    plan: dict[str, Any] = {"model": model, "gpus": gpus, "tp": tp, "pp": pp, "cp": cp, "dp": "zero1",
                            "seq_len": 8192, "global_batch_tokens": gbs * 8192, "micro_batch_size": 1,
                            "precision": "fp8", "checkpointing": "none", "fused_kernels": True}
    if vp > 1:
        plan["vp"] = vp
    return plan


@dataclass
class Row:
    name: str
    source: str
    plan: dict[str, Any]
    hardware: str
    network: str
    #: What was published: "tokens_per_s_per_gpu", "tflops_per_gpu", "memory_gib".
    published: dict[str, float]
    fit: bool = False
    #: What the predictor leaves out that this run used (said next to its error).
    lacks: list[str] = field(default_factory=list)


ROWS = [
    Row("Llama 3.1 8B, FSDP 8, 8 GPUs", TITAN + ", Table 1 row FSDP",
        {"model": "llama3-8b", "gpus": 8, "dp": "fsdp", "seq_len": 8192, "global_batch_tokens": 16 * 8192,
         "micro_batch_size": 2, "checkpointing": "selective"},
        "h100-500w", "ib-400g", {"tokens_per_s_per_gpu": 5762, "memory_gib": 82.4}),
    Row("Llama 3.1 8B, FSDP 128, 128 GPUs", TITAN + ", Table 3 row FSDP",
        {"model": "llama3-8b", "gpus": 128, "dp": "fsdp", "seq_len": 8192, "global_batch_tokens": 256 * 8192,
         "micro_batch_size": 2, "checkpointing": "selective"},
        "h100-500w", "ib-400g", {"tokens_per_s_per_gpu": 5605, "memory_gib": 67.0}, fit=True),
    Row("Llama 3.1 70B, FSDP 32 x TP 8, 256 GPUs", TITAN + ", Table 4 row 2D",
        {"model": "llama3-70b", "gpus": 256, "tp": 8, "dp": "fsdp", "seq_len": 8192,
         "global_batch_tokens": 512 * 8192, "micro_batch_size": 16, "checkpointing": "full", "precision": "fp8",
         "fused_kernels": True},  # torch.compile
        "h100-500w", "ib-400g", {"tokens_per_s_per_gpu": 829, "memory_gib": 71.9}),
    Row("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8 (1F1B), 512 GPUs", TITAN + ", Table 5 row 1F1B",
        {"model": "llama3-405b", "gpus": 512, "tp": 8, "pp": 8, "dp": "fsdp", "seq_len": 8192,
         # local batch 32 in torchtitan's default number of micro-batches, one per stage (8): 4 sequences each
         "global_batch_tokens": 256 * 8192, "micro_batch_size": 4, "schedule": "1f1b", "checkpointing": "full",
         "precision": "fp8", "fused_kernels": True},  # torch.compile
        "h100-500w", "ib-400g", {"tokens_per_s_per_gpu": 100, "memory_gib": 82.5}, lacks=["async TP"]),
    Row("Llama 3 405B, TP 8 x PP 16 x DP 64, 8,192 GPUs", LLAMA3 + ", row 1",
        {"model": "llama3-405b", "gpus": 8192, "tp": 8, "pp": 16, "dp": "fsdp", "seq_len": 8192,
         "global_batch_tokens": 2048 * 8192, "micro_batch_size": 1, "schedule": "interleaved", "chunks": 2,
         "checkpointing": "none"},
        "h100-sxm", "roce-400g", {"tflops_per_gpu": 430},
        lacks=["the paper's own interleaved schedule (depth not published: 2 chunks assumed)"]),
    Row("Llama 3 405B, TP 8 x PP 16 x DP 128, 16,384 GPUs", LLAMA3 + ", row 2",
        {"model": "llama3-405b", "gpus": 16384, "tp": 8, "pp": 16, "dp": "fsdp", "seq_len": 8192,
         "global_batch_tokens": 2048 * 8192, "micro_batch_size": 1, "schedule": "interleaved", "chunks": 2,
         "checkpointing": "none"},
        "h100-sxm", "roce-400g", {"tflops_per_gpu": 400},
        lacks=["the paper's own interleaved schedule (depth not published: 2 chunks assumed)"]),
    Row("Llama 3 405B long context, TP 8 x CP 16 x PP 16 x DP 8, 16,384 GPUs", LLAMA3 + ", row 3 (seq 131,072)",
        {"model": "llama3-405b", "gpus": 16384, "tp": 8, "cp": 16, "pp": 16, "dp": "fsdp", "seq_len": 131072,
         "global_batch_tokens": 128 * 131072, "micro_batch_size": 1, "schedule": "interleaved", "chunks": 2,
         "checkpointing": "none", "cp_rotate": "allgather"},
        "h100-sxm", "roce-400g", {"tflops_per_gpu": 380},
        lacks=["the paper's own interleaved schedule (depth not published: 2 chunks assumed)",
               "the paper gathers K and V before GQA's repeat (8 heads), torch's ring after it (128)",
               "one efficiency for matmuls and attention, where attention is most of a 131k step"]),
    Row("Llama 3 8B, CP 2, 8 GPUs, FP8", NEMO, _megatron("llama3-8b", 8, 128, 1, 1, 2, 1), "h100-sxm", "ib-400g",
        {"tokens_per_s_per_gpu": 12273, "tflops_per_gpu": 711}),
    Row("Llama 3 70B, TP 4 x PP 4 x CP 2 x VP 5, 64 GPUs, FP8", NEMO, _megatron("llama3-70b", 64, 128, 4, 4, 2, 5),
        "h100-sxm", "ib-400g", {"tokens_per_s_per_gpu": 1524, "tflops_per_gpu": 734}),
]

# Megatron-Bridge's DGX-H100 rows: (release, model, GPUs, global batch, tp, pp, cp, vp, tokens/s/GPU, TFLOP/s/GPU);
# "FSDP 0" there is DDP with the distributed optimizer (zero1); the 8B row shards (FSDP).
_BRIDGE_ROWS = [
    ("25.11", "llama3-8b", 8, 128, 1, 1, 1, 1, 14451, 744),
    ("25.11", "llama3-70b", 64, 128, 4, 8, 1, 5, 1602, 719),
    ("25.11", "llama3-405b", 1024, 512, 8, 8, 2, 8, 292, 737),
    ("26.04.01", "llama3-70b", 64, 256, 4, 8, 1, 5, 1664, 731),
    ("26.04.01", "llama3-405b", 1024, 1536, 8, 8, 2, 8, 328, 827),
]
ROWS += [
    Row(f"{model}, TP {tp} x PP {pp} x CP {cp} x VP {vp}, {gpus:,} GPUs, FP8 ({release})",
        BRIDGE.format(release=f"{release} container"),
        {**_megatron(model, gpus, gbs, tp, pp, cp, vp), **({"dp": "fsdp"} if model == "llama3-8b" else {})},
        "h100-sxm", "ib-400g", {"tokens_per_s_per_gpu": tokens, "tflops_per_gpu": tflops},
        fit=(release, model) == ("25.11", "llama3-8b"))
    for release, model, gpus, gbs, tp, pp, cp, vp, tokens, tflops in _BRIDGE_ROWS
]


def _predicted(pred: model.Prediction, key: str, precision: str) -> float:
    if key == "tokens_per_s_per_gpu":
        return pred.tokens_per_s_per_gpu
    if key == "tflops_per_gpu":  # model FLOPs per second: MFU is over the plan's precision's peak
        return pred.mfu * scale.hardware.HARDWARE[pred.hardware].peak_flops[precision] / 1e12
    return pred.memory_per_gpu_bytes / 2**30


def _fit(report: Any, row: Row) -> float:
    """The efficiency at which the row's predicted throughput is the published one (bisection)."""
    low, high = 0.05, 1.0
    want = row.published["tokens_per_s_per_gpu"]
    for _ in range(50):
        mid = (low + high) / 2
        got = model.predict_report(report, row.hardware, row.network, efficiency=mid).tokens_per_s_per_gpu
        low, high = (mid, high) if got < want else (low, mid)
    return (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fit", action="store_true", help="refit each part's efficiency on its fit row and use it")
    parser.add_argument("--only", default="", help="rows whose name contains this")
    parser.add_argument("--cache", type=Path, help="keep the dry runs' reports in this file and reuse them")
    args = parser.parse_args()
    rows = [r for r in ROWS if args.only in r.name]
    cached: dict[str, Any] = pickle.loads(args.cache.read_bytes()) if args.cache and args.cache.exists() else {}
    reports, refused = {}, {}
    for row in rows:
        t0 = time.perf_counter()
        plan = scale.Plan(**row.plan)
        key = json.dumps(plan.to_json(), sort_keys=True)  # what the dry run runs (not fused_kernels: the predictor's)
        if key in cached:
            reports[row.name] = dataclasses.replace(cached[key], plan=plan)
            continue
        try:
            reports[row.name] = scale.dry_run(plan, timeout=1200)  # slow beside other work
        except LabUsageError as exc:  # a plan the dry run does not model yet: its row says why
            refused[row.name] = str(exc)
            continue
        print(f"dry run of {row.name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if args.cache:
            cached[key] = reports[row.name]
            args.cache.write_bytes(pickle.dumps(cached))
    efficiencies: dict[str, float] = {}  # by part: refitted with --fit, else each profile's own
    for row in (r for r in rows if r.fit and args.fit and r.name in reports):
        efficiencies[row.hardware] = _fit(reports[row.name], row)
        print(f"{row.hardware}'s efficiency fitted on {row.name}: {efficiencies[row.hardware]:.4f}")
    print("\n| run | published | predicted | error | source; what the model lacks |")
    print("|---|---|---|---|---|")
    for row in rows:
        if row.name in refused:
            print(f"| {row.name} | {', '.join(f'{v:,.0f}' for v in row.published.values())} | not predicted: "
                  f"{refused[row.name]} | | {row.source} |")
            continue
        pred = model.predict_report(reports[row.name], row.hardware, row.network,
                                    efficiency=efficiencies.get(row.hardware))
        for key, value in row.published.items():
            got = _predicted(pred, key, reports[row.name].plan.precision)
            error = (got - value) / value
            unit = {"tokens_per_s_per_gpu": "tokens/s/GPU", "tflops_per_gpu": "TFLOP/s/GPU", "memory_gib": "GiB"}[key]
            fitted = ["fit row"] if row.fit and key not in ("memory_gib", "tflops_per_gpu") else []
            note = "; ".join([row.source, *fitted, *row.lacks])
            print(f"| {row.name} | {value:,.1f} {unit} | {got:,.1f} | {100 * error:+.0f}% | {note} |")
        said = str(pred).replace("\n", "; ")  # a plan over the GPU's memory says so on a second line
        print(f"|   | where the predicted step goes | {said} | | |")


if __name__ == "__main__":
    main()
