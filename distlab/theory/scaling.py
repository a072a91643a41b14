"""Time and how it scales: the pipeline bubble, speed-up and efficiency (strong and weak scaling,
Amdahl), training and epoch time, and what failures cost a job as it grows (lost work, the cluster's
MTBF, the checkpoint interval)."""

from __future__ import annotations

import math

from ._checks import _count, _fraction, _non_negative, _positive
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
    p = _count("stages", stages)
    limit = _fraction("max_bubble_fraction", max_bubble_fraction)
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
    compute = _non_negative("compute_time_s", compute_time_s)
    comm = _non_negative("comm_time_s", comm_time_s)
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
    compute = _positive("compute_time_s", compute_time_s)
    exposed = _non_negative("comm_time_s", comm_time_s) * (1 - _fraction("overlap_fraction", overlap_fraction))
    return compute / (compute + exposed)


def strong_scaling_speedup(
    compute_time_one_worker_s: float, comm_time_s: float, workers: int, overlap_fraction: float = 0.0
) -> float:
    """The speed-up the cost model predicts for a fixed job (strong scaling) on ``workers`` workers.

    One worker computes a step in ``compute_time_one_worker_s``; N workers each compute 1/N of it and
    then pay ``comm_time_s`` of communication per step (the all-reduce at N workers), of which
    ``overlap_fraction`` hides behind the backward pass: ``T1 / (T1/N + exposed communication)``.
    """
    compute = _positive("compute_time_one_worker_s", compute_time_one_worker_s)
    n = _count("workers", workers)
    exposed = _non_negative("comm_time_s", comm_time_s) * (1 - _fraction("overlap_fraction", overlap_fraction))
    return compute / (compute / n + exposed)


def weak_scaling_efficiency(time_one_worker_s: float, time_n_workers_s: float) -> float:
    """T(1) / T(N) when each of the N workers does the work the one did (weak scaling): 1.0 is perfect.

    This is not a speed-up: N workers did N times the work in ``time_n_workers_s``. The speed-up is
    T(1) / T(N) for the *same* total work (:func:`speedup`).
    """
    return _positive("time_one_worker_s", time_one_worker_s) / _positive("time_n_workers_s", time_n_workers_s)


def speedup(time_one_worker_s: float, time_n_workers_s: float) -> float:
    """How many times faster N workers finish the same job than one (strong scaling: same total work)."""
    return _positive("time_one_worker_s", time_one_worker_s) / _positive("time_n_workers_s", time_n_workers_s)


def parallel_efficiency(time_one_worker_s: float, time_n_workers_s: float, workers: int) -> float:
    """Speed-up per worker: 1.0 is perfect scaling."""
    return speedup(time_one_worker_s, time_n_workers_s) / _count("workers", workers)


def amdahl_speedup(parallel_fraction: float, workers: int) -> float:
    """Amdahl's law: the best speed-up when only ``parallel_fraction`` of the work spreads over workers."""
    share = _fraction("parallel_fraction", parallel_fraction)
    return 1 / ((1 - share) + share / _count("workers", workers))


def training_time_s(batches: int, step_time_s: float) -> float:
    """Training time grows linearly with the number of batches."""
    return _count("batches", batches, minimum=0) * _non_negative("step_time_s", step_time_s)


def epoch_time_s(
    samples: float, samples_per_s_per_device: float, devices: int = 1, scaling_efficiency: float = 1.0
) -> float:
    """Time of one pass over ``samples`` at a device's throughput, spread over ``devices``."""
    efficiency = _fraction("scaling_efficiency", scaling_efficiency)
    if efficiency == 0:
        raise ValueError("scaling_efficiency must be above 0 (1.0 is perfect scaling)")
    rate = _positive("samples_per_s_per_device", samples_per_s_per_device) * _count("devices", devices) * efficiency
    return _non_negative("samples", samples) / rate


# --------------------------------------------------------------------------------------------------
# Fault tolerance
# --------------------------------------------------------------------------------------------------


def lost_work_s(elapsed_s: float, checkpoint_interval_s: float) -> float:
    """Work redone after a failure at ``elapsed_s`` when a checkpoint is written every interval."""
    return _non_negative("elapsed_s", elapsed_s) % _positive("checkpoint_interval_s", checkpoint_interval_s)


def cluster_mtbf_s(device_mtbf_s: float, devices: int) -> float:
    """Mean time between failures of a job that stops when any of ``devices`` fails (independent failures)."""
    return _positive("device_mtbf_s", device_mtbf_s) / _count("devices", devices)


def optimal_checkpoint_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's approximation of the best checkpoint interval: sqrt(2 * checkpoint cost * MTBF)."""
    return math.sqrt(2 * _positive("checkpoint_cost_s", checkpoint_cost_s) * _positive("mtbf_s", mtbf_s))
