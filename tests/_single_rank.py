"""A real 1-rank gloo process group in the test process: DDP, ZeRO and the flight recorder without a cluster."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["single_rank_group"]


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """``torch.distributed`` initialised as rank 0 of 1 (in-memory store) for the block, destroyed after."""
    assert not dist.is_initialized(), "a process group is already up in this test process"
    before = os.environ.get("TORCH_FR_BUFFER_SIZE")
    os.environ["TORCH_FR_BUFFER_SIZE"] = before or "64"  # the flight recorder on, as on distlab's ranks
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if before is None:
            del os.environ["TORCH_FR_BUFFER_SIZE"]
