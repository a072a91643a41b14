"""The environment distlab's local engines start with: glibc's malloc keeps freed tensor memory.

A training step frees and allocates the same large tensors every time (``zero_grad()`` drops
the gradients, backward makes new ones). With glibc's defaults such a block is handed back to
the kernel when freed (``munmap``, or a trim of the heap's top) and every page of it faults in
again, zero-filled, the next step. Measured on this project's 2-core VM, one process, an MLP
trained with SGD: 3,064 page faults a step at 4.2M parameters (28.0 ms a step) and 3,281 at
12M (63.9 ms); with the two settings below, 3 and 0 faults, 23.3 and 57.6 ms. Which of several
models in one process pays depends on where their blocks land in the heap, so it also made
throughput comparisons between models in one process swing at random (benchmarks/RESULTS.md).

What it costs: memory a rank freed stays with the rank (its resident size keeps its peak) until
it exits. glibc caps the mmap threshold at 32 MiB: tensors larger than that are still mapped
fresh each time. Allocators such as jemalloc or tcmalloc (``LD_PRELOAD``) do the same job; a
user who chose one, or set any of glibc's malloc variables, keeps exactly what they set.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

__all__ = ["engine_environment"]

#: Blocks below this come from the heap and are reused; glibc refuses values above 32 MiB.
MMAP_THRESHOLD = 32 * 1024 * 1024
#: Free memory at the heap's top is returned to the kernel only beyond this much.
TRIM_THRESHOLD = 4 * 1024**3


def engine_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to an engine's environment, given the environment it inherits."""
    if not sys.platform.startswith("linux"):
        return {}  # the variables are glibc's
    chosen = "GLIBC_TUNABLES" in parent or "LD_PRELOAD" in parent or any(k.startswith("MALLOC_") for k in parent)
    if chosen:
        return {}
    # Setting either threshold switches off glibc's own adjustment of both, so both are set.
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
