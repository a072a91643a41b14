"""fsdp-shard-sizes: the mistakes learners make counting what FSDP2's shards hold and allocate, each named
(graded by test_exercises_graded.py)."""

from __future__ import annotations

import math

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

harness = Harness("fsdp-shard-sizes")
lab = learners_lab()

_BYTES = """

def shard_bytes(shapes, world_size):
    return sum(4 * math.ceil(shape[0] / world_size) * math.prod(shape[1:]) for shape in shapes)
"""

# numpy's array_split: the remainder spread over the first ranks.
SPREAD_REMAINDER = """
import math

def shard_rows(rows, world_size, rank):
    return rows // world_size + (rank < rows % world_size)
""" + _BYTES

# A full chunk on every rank, past the end of the rows.
FULL_CHUNK_EVERYWHERE = """
import math

def shard_rows(rows, world_size, rank):
    return math.ceil(rows / world_size)
""" + _BYTES

_ROWS = """
import math

def shard_rows(rows, world_size, rank):
    chunk = math.ceil(rows / world_size)
    return max(0, min(chunk, rows - rank * chunk))

"""

# The bytes of the rows this rank holds, not what it allocates.
UNPADDED = _ROWS + """
def shard_bytes(shapes, world_size):
    rank = dist.get_rank()
    return sum(4 * shard_rows(shape[0], world_size, rank) * math.prod(shape[1:]) for shape in shapes)
"""

ELEMENTS = _ROWS + """
def shard_bytes(shapes, world_size):
    return sum(math.ceil(shape[0] / world_size) * math.prod(shape[1:]) for shape in shapes)
"""

# The model's bytes over the ranks, as if every parameter split evenly.
MODEL_OVER_WORLD = _ROWS + """
def shard_bytes(shapes, world_size):
    return round(sum(4 * math.prod(shape) for shape in shapes) / world_size)
"""

MISTAKES = {
    "spread-remainder": (SPREAD_REMAINDER, "numpy's array_split"),
    "full-chunk-everywhere": (FULL_CHUNK_EVERYWHERE, "only while rows last"),
    "unpadded": (UNPADDED, "padded to the full chunk"),
    "elements": (ELEMENTS, "elements, not bytes"),
    "model-over-world": (MODEL_OVER_WORLD, "the padding of each parameter"),
}


def reference_measures(result):
    # What the task says FSDP2 does, as rank 0 (whose shard is always a full chunk) measured it: its
    # rows are ceil(rows / world_size) of each parameter, and its storage that chunk padded, 4 bytes
    # an element, whatever the shape.
    for case in result.cases:
        shapes, world = case.measured["shapes"], case.world_size
        assert case.measured["rows"] == [math.ceil(shape[0] / world) for shape in shapes]
        assert case.measured["allocated"] == sum(4 * math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes)
MISTAKES_GRADED_AT = (3,)  # every mistake shows in a world of 3
