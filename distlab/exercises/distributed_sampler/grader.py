"""Grader of ``distributed-sampler``: the learner's ``ShardSampler`` splits a data set's indices over the ranks.

Every rank builds the sampler with its own rank and the world's size and lists its indices for
epoch 0, epoch 1, epoch 0 again, another seed, and shuffle=False; it also builds the sampler for every
*other* rank (its view of the whole split). One ``all_gather_object`` brings everything to every rank,
which then checks the same things in the same order: equal lengths of ceil(n / N), ``len`` agreeing
with the iteration, indices in range, every index covered with repeats only in the padding, the
ordered split for shuffle=False, a new order per epoch and per seed, the same order for the same
epoch, and every rank's view of the split agreeing with the others. A problem is reported by the rank
it concerns (rank 0 for the split as a whole); the others pass, so the feedback names one rank.
Whether the split is exactly torch's ``DistributedSampler``'s is measured, not required.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from typing import Literal, Protocol, SupportsInt, TypedDict, cast

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from ...rank.exercise import Learner, failed, passed

# Below this many indices two epochs (or seeds) may give the same order by chance (1 in n!): only
# larger data sets are required to be reshuffled.
_RESHUFFLE_FROM = 10


class Case(TypedDict):
    name: str
    length: int  # the data set's
    shuffle: bool
    seed: int


class _Sampler(Protocol):
    """What the grader asks of a learner's ShardSampler (a missing method raises in their code's place)."""

    def set_epoch(self, epoch: int) -> None: ...
    def __iter__(self) -> Iterator[SupportsInt]: ...
    def __len__(self) -> int: ...


class _Runs(TypedDict):
    """One rank's samplers' indices, sent to every rank."""

    epoch0: list[int]
    len: int
    epoch1: list[int]
    again: list[int]
    other_seed: list[int]
    in_order: list[int]
    view: list[list[int]]  # rank r's epoch 0, as a sampler built here for rank r gives it


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    n = world_size
    sizes = [
        ("divisible by the world size", n * rng.randrange(5, 40), True),
        ("not divisible by the world size", n * rng.randrange(5, 40) + rng.randrange(1, n), True),
        ("smaller than the world size", rng.randrange(1, n), True),
        ("in order (shuffle=False), not divisible", n * rng.randrange(3, 20) + rng.randrange(1, n), False),
        ("large", rng.randrange(1000, 5000), True),
    ]
    return [
        {
            "name": f"{_count(length, 'index', 'indices')}, {what}",
            "length": length,
            "shuffle": shuffle,
            "seed": rng.randrange(2**16),
        }
        for what, length, shuffle in sizes
    ]


def _listed(sampler: _Sampler) -> list[int]:
    sampler.set_epoch(0)
    return [int(i) for i in sampler]


def _runs(case: Case, learner: Learner, rank: int, world: int) -> _Runs:
    """What this rank's samplers give: the learner's code runs here, before any collective of the grader's."""
    make = learner["ShardSampler"]
    n, shuffle, seed = case["length"], case["shuffle"], case["seed"]
    sampler: _Sampler = make(n, world, rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(0)
    epoch0 = [int(i) for i in sampler]
    length = len(sampler)
    sampler.set_epoch(1)
    epoch1 = [int(i) for i in sampler]
    sampler.set_epoch(0)
    again = [int(i) for i in sampler]
    return {
        "epoch0": epoch0,
        "len": length,
        "epoch1": epoch1,
        "again": again,
        "other_seed": _listed(make(n, world, rank, shuffle=shuffle, seed=seed + 1)),
        "in_order": _listed(make(n, world, rank, shuffle=False, seed=seed)),
        "view": [_listed(make(n, world, r, shuffle=shuffle, seed=seed)) for r in range(world)],
    }


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _runs(case, learner, rank, world)
    every: list[_Runs] = [mine] * world  # each replaced by that rank's
    dist.all_gather_object(every, mine)  # the grader's one collective, made on every rank whatever the learner did

    problem = _problem(case, every, world)
    n, per_rank = case["length"], math.ceil(case["length"] / world)
    # The sampler takes only len() of its dataset: the indices themselves stand for one.
    indices = cast("Dataset[int]", range(n))
    torch_sampler: DistributedSampler[int] = DistributedSampler(
        indices, num_replicas=world, rank=rank, shuffle=case["shuffle"], seed=case["seed"]
    )
    torch_sampler.set_epoch(0)
    measured = {
        "samples_per_rank": per_rank,
        "padding": per_rank * world - n,
        "same_as_torch": int(list(torch_sampler) == mine["epoch0"]),
    }
    if problem is not None and problem[0] == rank:
        return failed(problem[1], **measured)
    return passed("the same indices as torch's DistributedSampler" if measured["same_as_torch"] else "", **measured)


def _problem(case: Case, every: list[_Runs], world: int) -> tuple[int, str] | None:
    """(the rank it concerns, what is wrong and the likely mistake), or None; the same on every rank."""
    n, shuffle = case["length"], case["shuffle"]
    split = [every[r]["epoch0"] for r in range(world)]
    for r in range(world):
        if every[r]["len"] != len(split[r]):
            return r, (
                f"len(sampler) is {every[r]['len']} but iterating it gives {len(split[r])} indices: "
                "__len__ must say how many indices __iter__ yields"
            )
    wrong = _split_problem(n, world, split, "")
    if wrong is not None:
        if shuffle and wrong[2] and _split_problem(n, world, [every[r]["in_order"] for r in range(world)], "") is None:
            return wrong[0], (
                f"{wrong[1]}. With shuffle=False the slices are right, so the ranks shuffle differently: every "
                "rank must draw the same permutation (a generator seeded with seed + epoch on every rank), "
                "never one seeded by its rank or the global random state"
            )
        return wrong[0], wrong[1]
    if not shuffle:
        return _order_problem(n, world, split)
    for r in range(world):
        for k in range(world):
            if every[k]["view"][r] != split[r]:
                return k, (
                    f"ShardSampler(..., rank={r}) built on rank {k} gives other indices than on rank {r} itself: "
                    "the split must depend only on the arguments (and the epoch), not on the process's own rank "
                    "or its global random state"
                )
    reshuffled: tuple[tuple[str, Literal["epoch1", "other_seed"]], ...] = (
        ("epoch 1", "epoch1"),
        ("seed + 1", "other_seed"),
    )
    for label, key in reshuffled:
        other = _split_problem(n, world, [every[r][key] for r in range(world)], f" ({label})")
        if other is not None:
            return other[0], other[1]
    for r in range(world):
        if every[r]["again"] != split[r]:
            return r, (
                "set_epoch(0) a second time gave another order than the first time: the same epoch must give "
                "the same order (seed a new generator with seed + epoch in __iter__ rather than drawing on from "
                "one that keeps its state)"
            )
    if n < _RESHUFFLE_FROM:
        return None
    if _order_problem(n, world, split) is None:
        return 0, "with shuffle=True the indices come in order: shuffle them (torch.randperm with a seeded generator)"
    if all(every[r]["epoch1"] == split[r] for r in range(world)):
        return 0, (
            "epoch 1 has the same order as epoch 0: set_epoch is ignored, so every epoch sees the data in the "
            "same order; shuffle with a generator seeded by seed + epoch"
        )
    if all(every[r]["other_seed"] == split[r] for r in range(world)):
        return 0, "seed and seed + 1 give the same order: the seed is ignored; seed the generator with seed + epoch"
    return None


def _split_problem(n: int, world: int, split: list[list[int]], label: str) -> tuple[int, str, bool] | None:
    """(rank, what, whether indices are missing while others repeat) if ``split`` is not a padded split of range(n)."""
    per_rank = math.ceil(n / world)
    for r, indices in enumerate(split):
        outside = [i for i in indices if not 0 <= i < n]
        if outside:
            return (
                r,
                f"index {outside[0]}{label} is out of range for a data set of {n} (0 to {n - 1}): off by one?",
                False,
            )
    lengths = [len(indices) for indices in split]
    if len(set(lengths)) > 1:
        r = next(r for r, length in enumerate(lengths) if length != max(lengths))
        return (
            r,
            (
                f"the ranks get {lengths} indices{label} from a data set of {n}: ranks would take different numbers of "
                f"steps and DDP would hang; pad every rank to ceil({n} / {world}) = {per_rank} indices by repeating "
                "indices from the start"
            ),
            False,
        )
    if lengths[0] != per_rank:
        if lengths[0] == n // world:
            why = f"the last {n - world * lengths[0]} indices are dropped: pad instead (drop_last=False)"
        elif abs(lengths[0] - per_rank) == 1:
            why = "an off-by-one in the number of indices per rank?"
        else:
            why = "each rank's share is ceil(dataset_len / num_replicas)"
        return (
            0,
            f"every rank gets {lengths[0]} indices{label}, expected ceil({n} / {world}) = {per_rank}: {why}",
            False,
        )
    where: dict[int, list[int]] = {}
    for r, indices in enumerate(split):
        for i in indices:
            where.setdefault(i, []).append(r)
    missing = [i for i in range(n) if i not in where]
    if missing:
        twice = next(i for i, ranks in where.items() if len(ranks) > 1)
        ranks = where[twice]
        on = f"twice on rank {ranks[0]}" if len(set(ranks)) == 1 else f"on ranks {ranks[0]} and {ranks[1]}"
        return (
            ranks[-1],
            (
                f"index {missing[0]}{label} is on no rank ({len(missing)} missing) while index {twice} is {on}: "
                "the slices overlap beyond the padding, which repeats "
                f"{_count(world * per_rank - n, 'index', 'indices')}"
            ),
            True,
        )
    return None


def _order_problem(n: int, world: int, split: list[list[int]]) -> tuple[int, str] | None:
    """None if ``split`` is the ordered strided (torch's) or contiguous split of range(n), padded from the start."""
    per_rank = math.ceil(n / world)
    padded = (list(range(n)) * (world + 1))[: per_rank * world]
    strided = [padded[r::world] for r in range(world)]
    contiguous = [padded[r * per_rank : (r + 1) * per_rank] for r in range(world)]
    if split in (strided, contiguous):
        return None
    r = next(r for r in range(world) if split[r] not in (strided[r], contiguous[r]))
    return r, (
        f"with shuffle=False rank {r} gets {_few(split[r])}, expected the indices in order, padded from the start: "
        f"strided as torch's DistributedSampler does ({_few(strided[r])}) or contiguous ({_few(contiguous[r])})"
    )


def _few(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:6]))
    return f"[{shown}{', ...' if len(indices) > 6 else ''}]"


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"
