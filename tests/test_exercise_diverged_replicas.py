"""diverged-replicas: the mistakes learners make fingerprinting replicas, each named (graded by
test_exercises_graded.py)."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

harness = Harness("diverged-replicas")
lab = learners_lab()

SUMS = """
def diverged(model):
    names = [name for name, _ in model.named_parameters()]
    mine = torch.stack([p.detach().double().sum() for _, p in model.named_parameters()])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone)
    return sorted(n for n, column in zip(names, table.T) if (column != column[0]).any())
"""

WITHIN_A_TOLERANCE = """
def diverged(model):
    names = [name for name, _ in model.named_parameters()]
    found = []
    for name, p in model.named_parameters():
        everyone = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(everyone, p.detach().contiguous())
        if not all(torch.allclose(everyone[0], other) for other in everyone):
            found.append(name)
    return sorted(found)
"""

THIS_RANK_ALONE = """
def diverged(model):
    import zlib

    return sorted(name for name, p in model.named_parameters()
                  if zlib.crc32(p.detach().numpy().tobytes()) != zlib.crc32(p.detach().numpy().tobytes()))
"""

ONLY_RANK_0_KNOWS = """
def diverged(model):
    import zlib

    names = [name for name, _ in model.named_parameters()]
    mine = torch.tensor([zlib.crc32(p.detach().contiguous().numpy().tobytes())
                         for _, p in model.named_parameters()], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world_size)] if rank == 0 else None
    dist.gather(mine, everyone, dst=0)
    if rank != 0:
        return []
    table = torch.stack(everyone)
    return sorted(n for n, column in zip(names, table.T) if (column != column[0]).any())
"""

MISTAKES = {
    "sums": (SUMS, "a sum or a norm does not see where each value is"),
    "within-a-tolerance": (WITHIN_A_TOLERANCE, "compare bit for bit, not within a tolerance"),
    "this-rank-alone": (THIS_RANK_ALONE, "compare every rank's fingerprints"),
    "only-rank-0-knows": (ONLY_RANK_0_KNOWS, "the ranks returned different lists"),
}
