"""Checking a training plan against the cost models: does it fit in memory, does it finish in time,
is the learning rate scaled to its global batch, does it watch what matters.

A pure helper for the planning exercise of notebook 11: :func:`check_plan` takes a plan (the kind of
data parallelism, the per-device batch, the accumulation steps, the learning rate, three metrics)
and a :class:`TrainingJob` (the model, the devices, the link, the recipe), and returns a
:class:`PlanReport` that says, check by check, what holds and what does not, with the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .. import checks
from ._checks import checked_count, checked_fraction, checked_positive
from .batch import global_batch_size, scaled_learning_rate
from .collectives import collective_time_s
from .communication import ring_allreduce_time_s
from .memory import memory_breakdown, state_bytes_per_parameter
from .scaling import expected_scaling_efficiency

#: parallelism -> ZeRO stage (FSDP's full sharding is stage 3).
PARALLELISMS: dict[str, int] = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}

#: metric -> (what it tells, kind). A plan should watch the run's health and its speed.
METRICS: dict[str, tuple[str, str]] = {
    "loss": ("training loss: divergence, a plateau, a bad learning rate", "health"),
    "validation_loss": ("held-out loss: whether the model generalises", "health"),
    "grad_norm": ("gradient norm: spikes before the loss diverges", "health"),
    "learning_rate": ("the schedule really applied (warm-up, decay)", "health"),
    "loss_scale": ("fp16's loss scale: overflows (bf16 needs none)", "health"),
    "throughput": ("samples per second: whether the run finishes in time", "speed"),
    "step_time": ("seconds per step, and its spread across ranks: stragglers", "speed"),
    "comm_time": ("time in all-reduce / all-gather per step: the communication share", "speed"),
    "mfu": ("model FLOPs utilisation: how much of the hardware the run uses", "speed"),
    "peak_memory": ("peak device memory: headroom before out-of-memory", "memory"),
}


@dataclass(frozen=True)
class TrainingJob:
    """What a plan is checked against. The defaults are the planning exercise of notebook 11.

    A 1B-parameter model trained with Adam in mixed precision (16 bytes per parameter, the ZeRO
    layout) on 6 devices of 16 GB, joined by 10 GB/s links; it must see 250,000 samples (sequences
    of 1,024 tokens) within 2 hours. One device computes 8 samples per second (6 x 1e9 x 1,024 FLOPs
    per sample, Kaplan et al. 2020, at about 50 TFLOP/s achieved). Activations take about 0.25 GB per
    sample of the per-device batch: with full recomputation a transformer layer keeps only its input,
    2sbh bytes, plus one layer's activations while it is recomputed, sbh(34 + 5as/h) (Korthikanti et
    al. 2022); for 24 layers, h = 2048, 16 heads, s = 1,024 that is 0.10 + 0.16 GB. The recipe's
    learning rate was tuned at a global batch of 256.
    """

    parameters: float = 1e9
    devices: int = 6
    device_memory_bytes: float = 16e9
    memory_headroom_fraction: float = 0.10  # kept free: allocator, runtime context, temporary buffers
    precision: str = "mixed"
    optimizer: str = "adam"
    activation_bytes_per_sample: float = 0.25e9
    samples_per_s_per_device: float = 8.0
    bandwidth_bytes_per_s: float = 10e9
    latency_s: float = 10e-6
    samples: float = 250_000
    time_budget_s: float = 2 * 3600.0
    reference_lr: float = 3e-4
    reference_batch: int = 256


@dataclass(frozen=True)
class PlanCheck:
    """One check of a plan: what was checked, whether it holds, and the numbers behind it."""

    name: str
    holds: bool
    detail: str

    def __str__(self) -> str:
        return f"{'holds' if self.holds else 'FAILS':>5}  {self.name}: {self.detail}"


@dataclass(frozen=True)
class PlanReport:
    """Every check of a plan, and the figures they were computed from (base units)."""

    checks: tuple[PlanCheck, ...]
    global_batch: int
    memory_per_device_bytes: float
    step_time_s: float
    run_time_s: float

    @property
    def holds(self) -> bool:
        return all(c.holds for c in self.checks)

    def verdicts(self) -> dict[str, bool]:
        """{check name: holds}."""
        return {c.name: c.holds for c in self.checks}

    def __str__(self) -> str:
        verdict = "the plan holds" if self.holds else "the plan does not hold yet"
        return "\n".join([*(str(c) for c in self.checks), verdict])

    def __repr__(self) -> str:
        return str(self)


def communication_per_step_s(
    parallelism: str, accumulation_steps: int, gradient_bytes: float, devices: int,
    bandwidth_bytes_per_s: float, latency_s: float = 0.0,
) -> float:
    """Communication of one optimizer step of data parallelism, ring collectives, no overlap.

    With ``S = gradient_bytes`` (the parameters are taken to be the gradients' size, as in the mixed
    and fp32 layouts) and ``A = accumulation_steps``: ``"ddp"`` keeps whole gradients, accumulates
    locally (``no_sync``) and all-reduces them once per step. ``"zero1"`` is PyTorch's
    ``ZeroRedundancyOptimizer`` under DDP, the form notebook 11 plans with: the same all-reduce, then
    each rank broadcasts the shard of the parameters it updated, an all-gather's worth,
    ``(N-1)/N * S`` per rank: 1.5 all-reduces per step. (The ZeRO paper's ZeRO-1, Rajbhandari et al.
    2020, reduce-scatters the gradients instead and moves one all-reduce's worth.) ``"zero2"`` keeps
    only its gradient shard, so each micro-batch's gradients are reduce-scattered (``S``), and the
    updated parameters all-gathered once (``S``): ``(A + 1)/2`` all-reduces. ``"zero3"`` / ``"fsdp"``
    gather the parameters before each forward and each backward and reduce-scatter the gradients, on
    every micro-batch: ``1.5 A`` all-reduces.
    """
    stage = _stage(parallelism)
    a = checked_count("accumulation_steps", accumulation_steps)
    allreduce = ring_allreduce_time_s(gradient_bytes, devices, bandwidth_bytes_per_s, latency_s)
    if stage == 0:
        return allreduce
    if stage == 1:
        broadcasts = collective_time_s("all_gather", gradient_bytes, devices, bandwidth_bytes_per_s, latency_s)
        return allreduce + broadcasts
    if stage == 2:
        return (a + 1) / 2 * allreduce
    return 1.5 * a * allreduce


def check_plan(
    parallelism: str,
    per_device_batch: int,
    accumulation_steps: int,
    lr: float,
    metrics: Sequence[str],
    job: TrainingJob | None = None,
) -> PlanReport:
    """Check a data-parallel training plan against ``job`` (by default the planning exercise).

    ``parallelism``: "ddp", "zero1", "zero2", "zero3" or "fsdp". Four checks: the memory per device
    (:func:`memory_breakdown` plus the activations of the per-device batch) fits with the job's
    headroom; the run sees ``job.samples`` within the time budget (compute per step from the device's
    rate, :func:`communication_per_step_s` on top, no overlap: a pessimistic model); the learning rate
    is the linear rule's from the recipe (:func:`scaled_learning_rate`) within 10%; three distinct
    metrics that watch both the run's health and its speed (:data:`METRICS`).
    """
    job = job or TrainingJob()
    stage = _stage(parallelism)
    per_device = checked_count("per_device_batch", per_device_batch)
    accumulation = checked_count("accumulation_steps", accumulation_steps)
    rate = checked_positive("lr", lr)
    devices = checked_count("devices", job.devices)
    headroom = checked_fraction("memory_headroom_fraction", job.memory_headroom_fraction)
    found: list[PlanCheck] = []
    GB = 1e9

    # Memory: the model states of this ZeRO stage, plus one micro-batch's activations.
    activations = per_device * job.activation_bytes_per_sample
    memory = memory_breakdown(job.parameters, devices, stage, job.precision, job.optimizer, activations)
    usable = job.device_memory_bytes * (1 - headroom)
    states = memory.total_bytes - activations
    found.append(PlanCheck(
        "memory per device",
        memory.total_bytes <= usable,
        f"{states / GB:.2f} GB of weights, gradients and optimizer states ({parallelism} over {devices}) "
        f"+ {activations / GB:.2f} GB of activations = {memory.total_bytes / GB:.2f} GB, "
        f"against {usable / GB:.1f} GB usable of {job.device_memory_bytes / GB:.0f} GB",
    ))

    # Time: compute per optimizer step, then the communication the stage needs, not overlapped.
    batch = global_batch_size(per_device, devices, accumulation)
    compute = per_device * accumulation / checked_positive("samples_per_s_per_device", job.samples_per_s_per_device)
    gradient_bytes = job.parameters * state_bytes_per_parameter(job.precision, job.optimizer).gradients
    comm = communication_per_step_s(
        parallelism, accumulation, gradient_bytes, devices, job.bandwidth_bytes_per_s, job.latency_s
    )
    step = compute + comm
    run = math.ceil(job.samples / batch) * step
    found.append(PlanCheck(
        "finishes in time",
        run <= job.time_budget_s,
        f"{math.ceil(job.samples / batch)} steps of {batch} samples x ({compute:.2f} s compute + {comm:.2f} s "
        f"communication) = {run / 3600:.2f} h against {job.time_budget_s / 3600:.1f} h "
        f"(efficiency {expected_scaling_efficiency(compute, comm):.0%})",
    ))

    # Learning rate: the linear rule from the recipe (a starting point, then tune, with warm-up).
    linear = scaled_learning_rate(job.reference_lr, job.reference_batch, batch)
    found.append(PlanCheck(
        "learning rate for the global batch",
        abs(rate - linear) <= 0.10 * linear,
        f"global batch {per_device} x {devices} x {accumulation} = {batch}, {batch / job.reference_batch:.3g}x the "
        f"recipe's {job.reference_batch}; linear rule from {job.reference_lr:g}: {linear:.4g}, yours {rate:.4g}",
    ))

    # Metrics: three distinct, known, watching health and speed.
    names = [checks.choice("metric", m, tuple(METRICS)) for m in _metric_list(metrics)]
    kinds = {METRICS[m][1] for m in names}
    missing = [k for k in ("health", "speed") if k not in kinds]
    detail = "; ".join(f"{m}: {METRICS[m][0]}" for m in names)
    if missing:
        detail += f"; nothing watches the run's {' or '.join(missing)}"
    if len(set(names)) != 3:
        detail = f"give three different metrics (got {len(set(names))}); " + detail
    found.append(PlanCheck("three metrics to watch", len(set(names)) == 3 and not missing, detail))

    return PlanReport(tuple(found), batch, memory.total_bytes, step, run)


def _stage(parallelism: str) -> int:
    checks.choice("parallelism", parallelism, tuple(PARALLELISMS))
    return PARALLELISMS[parallelism]


def _metric_list(metrics: Sequence[str]) -> list[str]:
    if isinstance(metrics, str) or not isinstance(metrics, Sequence) or not metrics:
        raise ValueError(
            f"metrics must be a list of names, like ['loss', 'throughput', 'peak_memory'], got {metrics!r}"
        )
    return list(metrics)
