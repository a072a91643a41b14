"""How many GPUs the ranks started on this machine will see, read without importing torch.

The notebook's process checks an impossible request (``--backend nccl`` with more ranks than GPUs)
before it starts engines. Asking torch would load it there, and ``torch.cuda.device_count()``
initialises the CUDA driver in the process that then starts the ranks: the pitfall of every notebook
launcher. So the count comes from what the NVIDIA driver shows (``/proc/driver/nvidia/gpus``, one
folder per GPU; else ``nvidia-smi -L``), narrowed by ``CUDA_VISIBLE_DEVICES`` as CUDA narrows it.
Where neither says anything and the machine has AMD's ROCm (``/dev/kfd``), the count is unknown and
the ranks, which do import torch, decide.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

__all__ = ["local_gpus", "visible"]

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
_SMI_TIMEOUT_S = 10.0


def local_gpus(
    proc: Path = NVIDIA_PROC, env: Mapping[str, str] = os.environ, rocm: Path = Path("/dev/kfd")
) -> int | None:
    """The GPUs a process started here sees; None if this cannot be told without torch."""
    physical = _from_proc(proc)
    if physical is None:
        physical = _from_smi()
    if physical is None:
        return None if rocm.exists() else 0
    return visible(physical, env.get("CUDA_VISIBLE_DEVICES"))


def visible(physical: int, mask: str | None) -> int:
    """The count CUDA gives under ``CUDA_VISIBLE_DEVICES=mask`` on a machine with ``physical`` GPUs.

    As torch reads the mask for its own NVML count (``torch.cuda._parse_visible_devices``): a list
    of indices, read up to the first negative one or one past the last GPU; a list of UUIDs
    (``GPU-...``, ``MIG-...``), up to the first entry of another kind; an entry repeated hides them all.
    """
    if mask is None:
        return physical
    entries = mask.split(",")
    if mask.startswith(("GPU-", "MIG-")):
        ids = list(itertools.takewhile(lambda e: e.startswith(mask[:4]), entries))
        return 0 if len(set(ids)) < len(ids) else min(len(ids), physical)
    ordinals: list[int] = []
    for entry in entries:
        digits = re.match(r"[+-]?\d+", entry.strip())
        ordinal = int(digits.group()) if digits else -1
        if ordinal in ordinals:
            return 0
        if ordinal < 0:
            break
        ordinals.append(ordinal)
    return next((i for i, o in enumerate(ordinals) if o >= physical), len(ordinals))


def _from_proc(proc: Path) -> int | None:
    try:
        return sum(1 for entry in proc.iterdir() if entry.is_dir())
    except OSError:
        return None


def _from_smi() -> int | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
