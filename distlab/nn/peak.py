"""The best matrix-multiply rate this process's device reaches: the denominator of MFU in the labs.

Model FLOPs utilisation (Chowdhery et al., 2022, "PaLM") is the model's FLOPs per second over the
hardware's peak. A CPU has no datasheet number that a lab could trust (it depends on the cores, the
threads torch uses, the vector units and the load on the machine), so the labs measure the peak instead:
the best rate of square matmuls, the densest work the device does, on the threads and the device this
process really uses.
"""

from __future__ import annotations

import time

import torch

from .. import checks

__all__ = ["peak_matmul_flops_per_s"]

# Each measurement times enough matmuls to last about this long, so a fast GPU's launch overheads and
# the timer's resolution do not count against it.
_MEASUREMENT_S = 0.02


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def peak_matmul_flops_per_s(
    size: int = 1024, dtype: torch.dtype = torch.float32, repeats: int = 10, device: torch.device | str | None = None
) -> float:
    """FLOPs per second of the fastest of ``repeats`` timed runs of (size x size) @ (size x size) matmuls.

    Each matmul counts 2 * size**3 FLOPs (a multiply and an add per term). The first run only warms up
    (allocation, kernel choice, caches). ``device``: by default the current CUDA device if there is
    one, else the CPU, with this process's torch threads (``torch.get_num_threads()``). On the CPU at
    the defaults it takes a few tenths of a second.
    """
    n = checks.whole("size", size, minimum=1, example="size=1024")
    runs = checks.whole("repeats", repeats, minimum=1, example="repeats=5")
    checks.instance("dtype", dtype, torch.dtype, what="a torch.dtype, like torch.float32", error=TypeError)
    where = _default_device() if device is None else torch.device(device)
    a = torch.randn(n, n, device=where).to(dtype)
    b = torch.randn(n, n, device=where).to(dtype)

    def timed(count: int) -> float:
        if where.type == "cuda":
            torch.cuda.synchronize(where)  # kernels run asynchronously: time them, not their launch
        start = time.perf_counter()
        for _ in range(count):
            torch.mm(a, b)
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        return time.perf_counter() - start

    timed(1)  # warm-up: allocation, kernel choice, caches (and CUDA's start on a first call)
    one = timed(1)
    per_run = max(1, round(_MEASUREMENT_S / max(one, 1e-9)))
    best = min(timed(per_run) for _ in range(runs))
    return 2 * n**3 * per_run / best
