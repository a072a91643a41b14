"""The global batch and the learning rate that goes with it, each rank's share of a dataset, and the
arithmetic of ranks: world size, global rank, a mean over every rank's samples."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .. import checks
from ._checks import checked_count, checked_non_negative, checked_number, checked_positive, checked_sequence

# --------------------------------------------------------------------------------------------------
# Global batch and learning rate
# --------------------------------------------------------------------------------------------------


def global_batch_size(per_device_batch: int, devices: int, accumulation_steps: int = 1) -> int:
    """Samples behind one optimizer step: per-device batch * devices * accumulation steps."""
    return (
        checked_count("per_device_batch", per_device_batch)
        * checked_count("devices", devices)
        * checked_count("accumulation_steps", accumulation_steps)
    )


_LR_RULES = ("linear", "sqrt")


def scaled_learning_rate(base_lr: float, base_batch: int, new_batch: int, rule: str = "linear") -> float:
    """The learning rate to start tuning from when the global batch goes from ``base_batch`` to ``new_batch``.

    ``rule="linear"`` multiplies by k = new/base (with warm-up, the usual rule for SGD); ``rule="sqrt"``
    multiplies by sqrt(k), a gentler rule often used with Adam. Either is a starting point, then tune.
    """
    checks.choice("rule", rule, _LR_RULES)
    k = checked_count("new_batch", new_batch) / checked_count("base_batch", base_batch)
    return checked_positive("base_lr", base_lr) * (k if rule == "linear" else math.sqrt(k))


def accumulation_steps_for(target_global_batch: int, per_device_batch: int, devices: int) -> int:
    """Accumulation steps that make ``per_device_batch * devices`` reach ``target_global_batch`` exactly."""
    target = checked_count("target_global_batch", target_global_batch)
    per_step = global_batch_size(per_device_batch, devices)
    if target % per_step:
        raise ValueError(
            f"target_global_batch {target} is not a multiple of per_device_batch * devices = {per_step}; "
            "pick a target that is, or change the per-device batch"
        )
    return target // per_step


def steps_per_epoch(dataset_size: int, global_batch: int, drop_last: bool = False) -> int:
    """Optimizer steps in one pass over ``dataset_size`` samples (a last partial batch counts unless dropped)."""
    size, batch = checked_count("dataset_size", dataset_size, minimum=0), checked_count("global_batch", global_batch)
    return size // batch if drop_last else -(-size // batch)


def samples_per_rank(dataset_size: int, world_size: int, drop_last: bool = False) -> int:
    """Samples each rank gets per epoch from ``torch.utils.data.DistributedSampler``.

    Without ``drop_last`` the sampler pads by repeating samples so every rank gets ceil(size / ranks);
    with it, the tail is dropped so every rank gets floor(size / ranks).
    """
    size, ranks = checked_count("dataset_size", dataset_size, minimum=0), checked_count("world_size", world_size)
    return size // ranks if drop_last else -(-size // ranks)


def sampler_padding_samples(dataset_size: int, world_size: int) -> int:
    """Samples ``DistributedSampler`` repeats (without ``drop_last``) so that ranks get equal shares."""
    return samples_per_rank(dataset_size, world_size) * world_size - dataset_size


# --------------------------------------------------------------------------------------------------
# Ranks and metrics
# --------------------------------------------------------------------------------------------------


def world_size(nodes: int, processes_per_node: int) -> int:
    """Ranks in the job, as torchrun counts them: nodes * processes per node."""
    return checked_count("nodes", nodes) * checked_count("processes_per_node", processes_per_node)


def global_rank(node_rank: int, local_rank: int, processes_per_node: int) -> int:
    """torchrun's RANK of a process: node_rank * processes_per_node + local_rank."""
    per_node = checked_count("processes_per_node", processes_per_node)
    local = checked_count("local_rank", local_rank, minimum=0)
    if local >= per_node:
        raise ValueError(f"local_rank must be below processes_per_node ({per_node}), got {local}")
    return checked_count("node_rank", node_rank, minimum=0) * per_node + local


def global_mean(sums: Sequence[float], counts: Sequence[float]) -> float:
    """The global mean from per-rank sums and counts (all-reduce both, then divide).

    Averaging the per-rank means instead is wrong when ranks saw different numbers of samples.
    """
    total_sum = sum(checked_number("sums", s) for s in checked_sequence("sums", sums))
    count_values = [checked_non_negative("counts", c) for c in checked_sequence("counts", counts)]
    if len(count_values) != len(sums):
        raise ValueError(f"give one count per sum: {len(sums)} sums, {len(count_values)} counts")
    total_count = sum(count_values)
    if total_count == 0:
        raise ValueError("counts add up to 0: there is no mean of zero samples")
    return total_sum / total_count
