"""Grader of ``fsdp-shard-sizes``: the rows each rank's FSDP2 shard of a parameter holds, and the bytes it allocates.

Each case makes parameters of the case's shapes on every rank, shards them with ``fully_shard`` over
the world, and reads each rank's shards: the rows of ``to_local()`` and the bytes of the storage behind
it (FSDP2 pads a rank's shard to the full chunk; the local tensor is a view of that padded buffer). The
learner's ``shard_rows`` is asked for every parameter on this rank, ``shard_bytes`` once; each rank
grades its own numbers, and a wrong one is named with the mistake it looks like.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ...rank.exercise import Learner, failed, passed
from ...theory import fsdp_shard_rows


class Case(TypedDict):
    name: str
    shapes: list[list[int]]


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    w = world_size
    # Rows that leave the last ranks empty: w + 1 rows are chunks of 2 over ceil((w + 1) / 2) ranks.
    mlp = [[rng.randrange(2 * w + 1, 6 * w), 5], [rng.randrange(2 * w + 1, 6 * w)], [w + 1, 3], [w + 1]]
    short = [[w - 1, 4], [1, rng.randrange(2, 6)], [2 * w, 3]]
    shapes = [[rng.randrange(1, 5 * w)] + [rng.randrange(1, 5) for _ in range(rng.randrange(0, 3))] for _ in range(5)]
    return [
        {"name": "an MLP's weights and biases, one layer's rows a few more than the ranks", "shapes": mlp},
        {"name": "an embedding with fewer rows than ranks, and one row", "shapes": short},
        {"name": "random shapes, 1-D to 3-D", "shapes": shapes},
    ]


def _shard(shapes: list[list[int]]) -> list[torch.Tensor]:
    module = nn.Module()
    module.params = nn.ParameterList(nn.Parameter(torch.randn(*shape)) for shape in shapes)
    fully_shard(module)
    return [p.to_local() if isinstance(p, DTensor) else p for p in module.params]


def _whole_number(value: object) -> int | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    world, rank = dist.get_world_size(), dist.get_rank()
    locals_ = _shard(case["shapes"])
    for shape, local in zip(case["shapes"], locals_, strict=True):
        rows, held = shape[0], local.shape[0]
        returned = learner["shard_rows"](rows, world, rank)
        got = _whole_number(returned)
        if got is None:
            return failed(f"shard_rows({rows}, {world}, {rank}) returned {returned!r:.60}: return a whole number "
                          "of rows")
        if got == held:
            continue
        chunk = math.ceil(rows / world)
        if got == rows // world + (rank < rows % world):
            why = ("that spreads the remainder over the first ranks (numpy's array_split); torch.chunk fills "
                   f"chunks of ceil({rows}/{world}) = {chunk} rows from rank 0 until the rows run out")
        elif got == chunk:
            why = f"every rank holds a full chunk of {chunk} only while rows last: {rank} x {chunk} are before it"
        elif got == rows // world:
            why = f"rows // world_size leaves the remainder out; the chunks are ceil({rows}/{world}) = {chunk} rows"
        else:
            why = f"the chunks are ceil({rows}/{world}) = {chunk} rows, rank 0 first, until the rows run out"
        split = [fsdp_shard_rows(rows, world, r) for r in range(world)]
        return failed(f"shard_rows({rows}, {world}, {rank}) returned {got}; this rank's shard holds {held} "
                      f"(the split {split}): {why}", rows=rows, held=held)

    allocated = sum(local.untyped_storage().nbytes() for local in locals_)
    shapes = [tuple(shape) for shape in case["shapes"]]
    returned = learner["shard_bytes"](shapes, world)
    got = _whole_number(returned)
    if got is None:
        return failed(f"shard_bytes(...) returned {returned!r:.60}: return a whole number of bytes")
    if got != allocated:
        numel = [math.prod(shape) for shape in shapes]
        held_bytes = sum(local.numel() * local.element_size() for local in locals_)
        if got == held_bytes:
            why = ("the bytes of the rows this rank holds; each rank allocates its shard padded to the full "
                   "chunk, the same size on every rank")
        elif got * 4 == allocated:
            why = "elements, not bytes: float32 is 4 bytes"
        elif got == 4 * sum(numel):
            why = "the whole model's bytes: each rank allocates only its (padded) shard"
        elif abs(got - 4 * sum(numel) / world) < 4:
            why = "the model's bytes over world_size: the padding of each parameter to whole chunks counts"
        else:
            why = "per parameter: ceil(rows / world_size) rows, padded, times a row's elements, 4 bytes each"
        return failed(f"shard_bytes returned {got}; rank {rank} allocates {allocated} bytes: {why}",
                      allocated=allocated)
    return passed(f"{len(shapes)} parameters, {allocated} bytes allocated on rank {rank}",
                  allocated=allocated, rows=[local.shape[0] for local in locals_], shapes=case["shapes"])
