"""distributed-sampler: the reference is torch's split; the mistakes learners make, each named (graded by
test_exercises_graded.py)."""

from __future__ import annotations

from _exercises import Harness

from distlab.exercises.results import ExerciseResult

harness = Harness("distributed-sampler")


def reference_measures(result: ExerciseResult) -> None:
    assert all(case.measured["same_as_torch"] == 1 for case in result.cases)
    assert any(case.measured["padding"] > 0 for case in result.cases)


# Everything but the one mistake is as in the reference.
_SAMPLER = """
import math


class ShardSampler:
    def __init__(self, dataset_len, num_replicas, rank, shuffle=True, seed=0):
        self.n, self.world, self.rank, self.shuffle, self.seed = dataset_len, num_replicas, rank, shuffle, seed
        self.epoch = 0
        self.per_rank = {per_rank}

    def set_epoch(self, epoch):
        {set_epoch}

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed({generator_seed})
            indices = torch.randperm(self.n, generator=g).tolist()
        else:
            indices = list(range(self.n))
        total = self.per_rank * self.world
        padding = total - len(indices)
        {pad}
        return iter({slice_})

    def __len__(self):
        return self.per_rank
"""
_RIGHT = {
    "per_rank": "math.ceil(dataset_len / num_replicas)",
    "set_epoch": "self.epoch = epoch",
    "generator_seed": "self.seed + self.epoch",
    "pad": "indices += (indices * math.ceil(padding / len(indices)))[:padding] if padding > 0 else []",
    "slice_": "indices[self.rank : total : self.world]",
}


def _sampler(**mistake: str) -> str:
    return _SAMPLER.format(**{**_RIGHT, **mistake})


MISTAKES = {
    # No padding: the ranks' shares differ by one when the length does not divide.
    "no-padding": (_sampler(per_rank="len(range(rank, dataset_len, num_replicas))", pad="pass"), "DDP would hang"),
    # Blocks of ceil(n / N) that start every floor(n / N): neighbours share indices, the last ones are lost.
    "overlapping-slices": (
        _sampler(slice_="indices[self.rank * (self.n // self.world) :][: self.per_rank]"),
        "the slices overlap beyond the padding",
    ),
    "ignores-set-epoch": (_sampler(set_epoch="pass"), "set_epoch is ignored"),
    "seeded-by-rank": (_sampler(generator_seed="self.seed + self.epoch + self.rank"), "the ranks shuffle differently"),
    "off-by-one": (_sampler(per_rank="dataset_len // num_replicas + 1"), "off-by-one"),
}

