"""At the scale the field trains at, without the GPUs: a plan's memory and collectives from its real
code dry-run in one process, and its step time, tokens/s, MFU and memory per GPU predicted on a
machine whose figures are cited (``hardware.py``). Imports no torch: the dry run is its own process.

    plan = scale.Plan(model="llama3-8b", gpus=1024, tp=8, seq_len=8192, global_batch_tokens=4 * 2**20)
    report = scale.dry_run(plan)
    pred = scale.predict_report(report, hardware="h100-sxm", network="ib-400g")
"""

from __future__ import annotations

from . import hardware
from .calibration import CALIBRATION_MODEL, Calibration, Measurement, calibrate, measure
from .dryrun_launcher import dry_run
from .hardware import HARDWARE, NETWORKS, Hardware, KernelRates, Network
from .models import MODELS, ModelConfig, parameters
from .plan import Plan
from .prediction import EFFICIENCY, Prediction, predict, predict_report, ranks_per_node
from .report import CollectiveCount, DryRunReport, RankKind
from .search import Checked, Search, search

__all__ = [
    "CALIBRATION_MODEL",
    "EFFICIENCY",
    "HARDWARE",
    "MODELS",
    "NETWORKS",
    "Calibration",
    "Checked",
    "CollectiveCount",
    "DryRunReport",
    "Hardware",
    "KernelRates",
    "Measurement",
    "ModelConfig",
    "Network",
    "Plan",
    "Prediction",
    "RankKind",
    "Search",
    "calibrate",
    "dry_run",
    "hardware",
    "measure",
    "parameters",
    "predict",
    "predict_report",
    "ranks_per_node",
    "search",
]
