"""The torch releases distlab is known to work with, checked when the compatibility modules are imported.

Its own module, below ``torchcompat`` and each of its siblings (``torchcompat_c10d``, ``_dispatch``,
``_compile``, ``_fake``, ``_torchft``), so that each imports the check first without importing the
others: ``torchcompat`` carries the staged sends (``staging``), which use two siblings.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["ALLOW_ANY_TORCH", "KNOWN_GOOD", "check_torch", "torch_version_problem"]

#: (major, minor) of the torch releases distlab is run on, from the first to one past the last:
#: 2.13 in CI, 2.11 on the lent GPU machines.
KNOWN_GOOD = ((2, 11), (2, 14))
#: Set to 1 to use a torch outside ``KNOWN_GOOD`` anyway.
ALLOW_ANY_TORCH = "DISTLAB_ALLOW_ANY_TORCH"
_SUGGESTED = "torch==2.13.0"


def torch_version_problem(version: str) -> str | None:
    """None for a torch version in ``KNOWN_GOOD``, else the one line that says what to do."""
    low, high = KNOWN_GOOD
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and low <= (int(found.group(1)), int(found.group(2))) < high:
        return None
    known = f"{low[0]}.{low[1]} to {high[0]}.{high[1] - 1}"
    return (
        f"distlab is known to work with torch {known}, and this is torch {version}: "
        f"install one of those (e.g. pip install {_SUGGESTED}), "
        f"or set {ALLOW_ANY_TORCH}=1 to try this one anyway"
    )


def check_torch(version: str, environ: Mapping[str, str]) -> None:
    """Refuse (ImportError, one line) a torch outside ``KNOWN_GOOD``; only warn when ``environ`` allows any."""
    problem = torch_version_problem(version)
    if problem is None:
        return
    if environ.get(ALLOW_ANY_TORCH) == "1":
        warnings.warn(f"{problem} ({ALLOW_ANY_TORCH}=1: trying it)", RuntimeWarning, stacklevel=3)
        return
    raise ImportError(problem)


check_torch(str(torch.__version__), os.environ)

# torch 2.13 gave the one-tensor collectives the names the notebooks and exercises use; 2.11 (the
# GPU machines' torch) has them only under their older names, with the same arguments.
for _new, _old in (("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor")):
    if not hasattr(dist, _new):
        setattr(dist, _new, getattr(dist, _old))
