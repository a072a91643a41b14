"""Time and how it scales: the pipeline bubble, speed-up and efficiency (strong and weak scaling,
Amdahl), training and epoch time, and what failures cost a job as it grows (lost work, the cluster's
MTBF, the checkpoint interval)."""

from __future__ import annotations

import math

from ._checks import checked_count, checked_fraction, checked_non_negative, checked_positive
from .pipeline import bubble_fraction

# --------------------------------------------------------------------------------------------------
# Pipelines
# --------------------------------------------------------------------------------------------------


def pipeline_bubble_fraction(stages: int, micro_batches: int) -> float:
    """Share of a pipeline step the stages sit idle (GPipe schedule): ``(p-1) / (m+p-1)``.

    The GPipe case of :func:`~distlab.theory.pipeline.bubble_fraction`, which also has 1F1B and interleaved.
    """
    return bubble_fraction(stages, micro_batches, "gpipe")


def micro_batches_for_bubble(stages: int, max_bubble_fraction: float) -> int:
    """Fewest micro-batches that keep the bubble at or under ``max_bubble_fraction``."""
    p = checked_count("stages", stages)
    limit = checked_fraction("max_bubble_fraction", max_bubble_fraction)
    if limit == 0:
        if p == 1:
            return 1
        raise ValueError("a pipeline of 2 or more stages always has a bubble: allow a fraction above 0")
    # (p-1)/(m+p-1) <= f  <=>  m >= (p-1)(1-f)/f; the small epsilon absorbs float error at exact fits.
    return max(1, math.ceil((p - 1) * (1 - limit) / limit - 1e-9))


# --------------------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------------------


def compute_comm_ratio(compute_time_s: float, comm_time_s: float) -> float:
    """Compute time per step over communication time per step (infinite when nothing is communicated)."""
    compute = checked_non_negative("compute_time_s", compute_time_s)
    comm = checked_non_negative("comm_time_s", comm_time_s)
    return compute / comm if comm else math.inf


def expected_scaling_efficiency(compute_time_s: float, comm_time_s: float, overlap_fraction: float = 0.0) -> float:
    """Expected efficiency of data parallelism: compute / (compute + exposed communication), per step.

    ``compute_time_s`` is one worker's compute per step and ``comm_time_s`` the communication per step
    *at the world size in question*: it grows with N (a ring all-reduce's ``2(N-1)/N`` and ``2(N-1)a``,
    :func:`ring_allreduce_time_s`), so weak-scaling efficiency falls as workers are added even though
    each worker's compute stays the same. In strong scaling, pass the compute of ``1/N`` of the job:
    the result is then the speed-up over N (:func:`strong_scaling_speedup` divided by N).
    ``overlap_fraction`` of the communication hides behind the backward pass (DDP's bucketing).
    """
    compute = checked_positive("compute_time_s", compute_time_s)
    comm = checked_non_negative("comm_time_s", comm_time_s)
    exposed = comm * (1 - checked_fraction("overlap_fraction", overlap_fraction))
    return compute / (compute + exposed)


def strong_scaling_speedup(
    compute_time_one_worker_s: float, comm_time_s: float, workers: int, overlap_fraction: float = 0.0
) -> float:
    """The speed-up the cost model predicts for a fixed job (strong scaling) on ``workers`` workers.

    One worker computes a step in ``compute_time_one_worker_s``; N workers each compute 1/N of it and
    then pay ``comm_time_s`` of communication per step (the all-reduce at N workers), of which
    ``overlap_fraction`` hides behind the backward pass: ``T1 / (T1/N + exposed communication)``.
    """
    compute = checked_positive("compute_time_one_worker_s", compute_time_one_worker_s)
    n = checked_count("workers", workers)
    comm = checked_non_negative("comm_time_s", comm_time_s)
    exposed = comm * (1 - checked_fraction("overlap_fraction", overlap_fraction))
    return compute / (compute / n + exposed)


def weak_scaling_efficiency(time_one_worker_s: float, time_n_workers_s: float) -> float:
    """T(1) / T(N) when each of the N workers does the work the one did (weak scaling): 1.0 is perfect.

    This is not a speed-up: N workers did N times the work in ``time_n_workers_s``. The speed-up is
    T(1) / T(N) for the *same* total work (:func:`speedup`).
    """
    one = checked_positive("time_one_worker_s", time_one_worker_s)
    return one / checked_positive("time_n_workers_s", time_n_workers_s)


def speedup(time_one_worker_s: float, time_n_workers_s: float) -> float:
    """How many times faster N workers finish the same job than one (strong scaling: same total work)."""
    one = checked_positive("time_one_worker_s", time_one_worker_s)
    return one / checked_positive("time_n_workers_s", time_n_workers_s)


def parallel_efficiency(time_one_worker_s: float, time_n_workers_s: float, workers: int) -> float:
    """Speed-up per worker: 1.0 is perfect scaling."""
    return speedup(time_one_worker_s, time_n_workers_s) / checked_count("workers", workers)


def amdahl_speedup(parallel_fraction: float, workers: int) -> float:
    """Amdahl's law: the best speed-up when only ``parallel_fraction`` of the work spreads over workers."""
    share = checked_fraction("parallel_fraction", parallel_fraction)
    return 1 / ((1 - share) + share / checked_count("workers", workers))


def training_time_s(batches: int, step_time_s: float) -> float:
    """Training time grows linearly with the number of batches."""
    return checked_count("batches", batches, minimum=0) * checked_non_negative("step_time_s", step_time_s)


def epoch_time_s(
    samples: float, samples_per_s_per_device: float, devices: int = 1, scaling_efficiency: float = 1.0
) -> float:
    """Time of one pass over ``samples`` at a device's throughput, spread over ``devices``."""
    efficiency = checked_fraction("scaling_efficiency", scaling_efficiency)
    if efficiency == 0:
        raise ValueError("scaling_efficiency must be above 0 (1.0 is perfect scaling)")
    per_device = checked_positive("samples_per_s_per_device", samples_per_s_per_device)
    rate = per_device * checked_count("devices", devices) * efficiency
    return checked_non_negative("samples", samples) / rate


# --------------------------------------------------------------------------------------------------
# Fault tolerance
# --------------------------------------------------------------------------------------------------


def lost_work_s(elapsed_s: float, checkpoint_interval_s: float) -> float:
    """Work redone after a failure at ``elapsed_s`` when a checkpoint is written every interval."""
    elapsed = checked_non_negative("elapsed_s", elapsed_s)
    return elapsed % checked_positive("checkpoint_interval_s", checkpoint_interval_s)


def cluster_mtbf_s(device_mtbf_s: float, devices: int) -> float:
    """Mean time between failures of a job that stops when any of ``devices`` fails (independent failures)."""
    return checked_positive("device_mtbf_s", device_mtbf_s) / checked_count("devices", devices)


def optimal_checkpoint_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's approximation of the best checkpoint interval: sqrt(2 * checkpoint cost * MTBF)."""
    return math.sqrt(2 * checked_positive("checkpoint_cost_s", checkpoint_cost_s) * checked_positive("mtbf_s", mtbf_s))
