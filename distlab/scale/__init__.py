"""At the scale the field trains at, without the GPUs: a plan's memory and collectives from its real
code dry-run in one process, and its step time, tokens/s, MFU and memory per GPU predicted on a
machine whose figures are cited (``hardware.py``). Imports no torch: the dry run is its own process.

    pred = scale.predict_report(report, hardware="h100-sxm", network="ib-400g")
"""

from __future__ import annotations

from . import hardware
from .hardware import HARDWARE, NETWORKS, Hardware, Network
from .prediction import EFFICIENCY, Prediction, predict, predict_report

__all__ = [
    "EFFICIENCY",
    "HARDWARE",
    "NETWORKS",
    "Hardware",
    "Network",
    "Prediction",
    "hardware",
    "predict",
    "predict_report",
]
