"""Cost models of distributed training, as plain functions.

Every quiz answer, dashboard estimate and notebook figure that is a number comes from here, so the
formulas live in one place. Names carry their units: a function ending in ``_s`` returns seconds,
``_bytes`` returns bytes, ``_bytes_per_s`` returns bytes per second; arguments are named the same way
(``size_bytes``, ``bandwidth_bytes_per_s``, ``latency_s``). Everything is in base units (bytes,
seconds); :func:`to_base_units` and :func:`parse_quantity` convert from "400 MB" or "5 us".

Bad arguments raise :class:`ValueError` with a message that names the argument and the fix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from . import checks

__all__ = [
    "DIMENSIONS",
    "UNITS",
    "LatencyBandwidthFit",
    "MemoryBreakdown",
    "StateBytes",
    "accumulation_steps_for",
    "activation_bytes",
    "algbw_bytes_per_s",
    "amdahl_speedup",
    "bucketed_allreduce_time_s",
    "busbw_bytes_per_s",
    "bytes_per_parameter",
    "cluster_mtbf_s",
    "compute_comm_ratio",
    "dimension_of",
    "epoch_time_s",
    "expected_scaling_efficiency",
    "expected_staleness_updates",
    "fit_latency_bandwidth",
    "from_base_units",
    "global_batch_size",
    "global_mean",
    "global_rank",
    "lost_work_s",
    "memory_breakdown",
    "memory_per_device_bytes",
    "micro_batches_for_bubble",
    "optimal_checkpoint_interval_s",
    "parallel_efficiency",
    "parameter_server_received_bytes",
    "parameter_server_time_s",
    "parse_quantity",
    "pipeline_bubble_fraction",
    "ring_allreduce_sent_bytes",
    "ring_allreduce_time_s",
    "sampler_padding_samples",
    "samples_per_rank",
    "scaled_learning_rate",
    "speedup",
    "state_bytes_per_parameter",
    "steps_per_epoch",
    "synchronous_step_time_s",
    "to_base_units",
    "training_time_s",
    "unit_dimension",
    "world_size",
]

# --------------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------------

#: dimension -> how a sentence names it ("'5 MB' is a size in bytes, not a time").
DIMENSIONS: dict[str, str] = {
    "time": "a time",
    "bytes": "a size in bytes",
    "bandwidth": "a bandwidth",
    "number": "a plain number",
}

#: unit -> (dimension, how many base units one of it is). Decimal prefixes (1 GB = 1e9 B) as network and
#: storage vendors quote them; binary ones (GiB) are there for memory as the OS reports it.
UNITS: dict[str, tuple[str, float]] = {
    "s": ("time", 1.0),
    "ms": ("time", 1e-3),
    "us": ("time", 1e-6),
    "µs": ("time", 1e-6),
    "ns": ("time", 1e-9),
    "min": ("time", 60.0),
    "h": ("time", 3600.0),
    "day": ("time", 86400.0),
    "yr": ("time", 365 * 86400.0),
    "B": ("bytes", 1.0),
    "KB": ("bytes", 1e3),
    "kB": ("bytes", 1e3),
    "MB": ("bytes", 1e6),
    "GB": ("bytes", 1e9),
    "TB": ("bytes", 1e12),
    "KiB": ("bytes", 2.0**10),
    "MiB": ("bytes", 2.0**20),
    "GiB": ("bytes", 2.0**30),
    "TiB": ("bytes", 2.0**40),
    "B/s": ("bandwidth", 1.0),
    "KB/s": ("bandwidth", 1e3),
    "MB/s": ("bandwidth", 1e6),
    "GB/s": ("bandwidth", 1e9),
    "TB/s": ("bandwidth", 1e12),
    "Gbit/s": ("bandwidth", 1e9 / 8),
    "": ("number", 1.0),
    "x": ("number", 1.0),
    "%": ("number", 0.01),
    "thousand": ("number", 1e3),
    "million": ("number", 1e6),
    "billion": ("number", 1e9),
}

_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(\S*(?:\s*/\s*s)?)\s*$")


def unit_dimension(unit: str) -> str:
    """The dimension of ``unit``: "time", "bytes", "bandwidth" or "number"."""
    try:
        return UNITS[unit][0]
    except KeyError:
        known = ", ".join(repr(u) for u in UNITS if u)
        raise ValueError(f"unknown unit {unit!r}; use one of {known}") from None


def to_base_units(value: float, unit: str) -> float:
    """``value`` given in ``unit``, in base units (seconds, bytes, bytes/s, plain numbers)."""
    unit_dimension(unit)  # raises with the list of units
    return _number("value", value) * UNITS[unit][1]


def from_base_units(value: float, unit: str) -> float:
    """``value`` given in base units, expressed in ``unit``."""
    unit_dimension(unit)
    return _number("value", value) / UNITS[unit][1]


def dimension_of(name: str) -> str:
    """The dimension a name carries by its suffix (``_bytes_per_s``, ``_bytes``, ``_s``), else "number"."""
    if name.endswith("_bytes_per_s"):
        return "bandwidth"
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith("_s"):
        return "time"
    return "number"


def parse_quantity(text: str, default_unit: str) -> float:
    """Read "24", "24 ms" or "0.024 s" as a number in base units.

    A bare number is taken in ``default_unit``; a unit written after it must have the same dimension.
    """
    if not isinstance(text, str):
        raise ValueError(f"expected text like '24 ms', got {text!r}")
    dimension = unit_dimension(default_unit)
    match = _QUANTITY.match(text)
    if match is None:
        example = f"'24' or '24 {default_unit}'" if default_unit else "'24'"
        raise ValueError(f"cannot read {text!r} as a number; write it like {example}")
    number, unit = match.group(1), re.sub(r"\s+", "", match.group(2)) or default_unit
    same_kind = ", ".join(u for u, (d, _) in UNITS.items() if d == dimension and u)
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r} in {text!r}; use one of {same_kind}")
    if UNITS[unit][0] != dimension:
        raise ValueError(f"{text!r} is {DIMENSIONS[UNITS[unit][0]]}, not {DIMENSIONS[dimension]}; use {same_kind}")
    return float(number) * UNITS[unit][1]


# --------------------------------------------------------------------------------------------------
# Argument checks: distlab.checks, so a user's mistake raises ValueError with the fix. Bound here to
# what holds for every theory function: a number typed with its unit ("400 MB") is pointed at
# parse_quantity, and counts may come as whole floats (1e6 samples, 4.0 workers; 2.5 workers is refused).
# --------------------------------------------------------------------------------------------------

_TEXT = "convert text first, e.g. parse_quantity('400 MB', 'B')"
_number = partial(checks.number, text=_TEXT)
_non_negative = partial(checks.non_negative, text=_TEXT)
_positive = partial(checks.positive, text=_TEXT)
_fraction = partial(checks.fraction, text=_TEXT)
_count = partial(checks.whole, minimum=1, integral_floats=True)


# --------------------------------------------------------------------------------------------------
# Global batch and learning rate
# --------------------------------------------------------------------------------------------------


def global_batch_size(per_device_batch: int, devices: int, accumulation_steps: int = 1) -> int:
    """Samples behind one optimizer step: per-device batch * devices * accumulation steps."""
    return (
        _count("per_device_batch", per_device_batch)
        * _count("devices", devices)
        * _count("accumulation_steps", accumulation_steps)
    )


_LR_RULES = ("linear", "sqrt")


def scaled_learning_rate(base_lr: float, base_batch: int, new_batch: int, rule: str = "linear") -> float:
    """The learning rate to start tuning from when the global batch goes from ``base_batch`` to ``new_batch``.

    ``rule="linear"`` multiplies by k = new/base (with warm-up, the usual rule for SGD); ``rule="sqrt"``
    multiplies by sqrt(k), a gentler rule often used with Adam. Either is a starting point, then tune.
    """
    checks.choice("rule", rule, _LR_RULES)
    k = _count("new_batch", new_batch) / _count("base_batch", base_batch)
    return _positive("base_lr", base_lr) * (k if rule == "linear" else math.sqrt(k))


def accumulation_steps_for(target_global_batch: int, per_device_batch: int, devices: int) -> int:
    """Accumulation steps that make ``per_device_batch * devices`` reach ``target_global_batch`` exactly."""
    target = _count("target_global_batch", target_global_batch)
    per_step = global_batch_size(per_device_batch, devices)
    if target % per_step:
        raise ValueError(
            f"target_global_batch {target} is not a multiple of per_device_batch * devices = {per_step}; "
            "pick a target that is, or change the per-device batch"
        )
    return target // per_step


def steps_per_epoch(dataset_size: int, global_batch: int, drop_last: bool = False) -> int:
    """Optimizer steps in one pass over ``dataset_size`` samples (a last partial batch counts unless dropped)."""
    size, batch = _count("dataset_size", dataset_size, minimum=0), _count("global_batch", global_batch)
    return size // batch if drop_last else -(-size // batch)


def samples_per_rank(dataset_size: int, world_size: int, drop_last: bool = False) -> int:
    """Samples each rank gets per epoch from ``torch.utils.data.DistributedSampler``.

    Without ``drop_last`` the sampler pads by repeating samples so every rank gets ceil(size / ranks);
    with it, the tail is dropped so every rank gets floor(size / ranks).
    """
    size, ranks = _count("dataset_size", dataset_size, minimum=0), _count("world_size", world_size)
    return size // ranks if drop_last else -(-size // ranks)


def sampler_padding_samples(dataset_size: int, world_size: int) -> int:
    """Samples ``DistributedSampler`` repeats (without ``drop_last``) so that ranks get equal shares."""
    return samples_per_rank(dataset_size, world_size) * world_size - dataset_size


# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------


def _ring_factor(workers: int) -> float:
    n = _count("workers", workers)
    return 2 * (n - 1) / n


def ring_allreduce_time_s(
    size_bytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0
) -> float:
    """Time of a ring all-reduce: ``2(N-1)/N * S/B + (N-1) * a``.

    Each worker sends 2(N-1)/N of the buffer (reduce-scatter, then all-gather) over a link of
    ``bandwidth_bytes_per_s``, and the ring pays ``latency_s`` per hop. One worker has nothing to do: 0 s.
    """
    n = _count("workers", workers)
    size = _non_negative("size_bytes", size_bytes)
    bandwidth = _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    latency = _non_negative("latency_s", latency_s)
    return _ring_factor(n) * size / bandwidth + (n - 1) * latency


def ring_allreduce_sent_bytes(size_bytes: float, workers: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``size_bytes``: 2(N-1)/N * S."""
    return _ring_factor(workers) * _non_negative("size_bytes", size_bytes)


def bucketed_allreduce_time_s(
    size_bytes: float,
    bucket_bytes: float,
    workers: int,
    bandwidth_bytes_per_s: float,
    latency_s: float = 0.0,
) -> float:
    """Ring all-reduce of ``size_bytes`` sent in buckets of ``bucket_bytes``, one after another.

    Every bucket pays the latency term again, so many tiny buckets (or tensors reduced one by one) are
    latency-bound; the bandwidth term is the same whatever the bucket size.
    """
    bandwidth_term_s = ring_allreduce_time_s(size_bytes, workers, bandwidth_bytes_per_s)
    buckets = math.ceil(size_bytes / _positive("bucket_bytes", bucket_bytes))
    return bandwidth_term_s + buckets * (workers - 1) * _non_negative("latency_s", latency_s)


def algbw_bytes_per_s(size_bytes: float, time_s: float) -> float:
    """Algorithm bandwidth of a collective: the buffer size over the time it took (nccl-tests' algbw)."""
    return _non_negative("size_bytes", size_bytes) / _positive("time_s", time_s)


def busbw_bytes_per_s(size_bytes: float, time_s: float, workers: int) -> float:
    """Bus bandwidth of an all-reduce: algbw * 2(N-1)/N, comparable with the link's speed whatever N is."""
    return algbw_bytes_per_s(size_bytes, time_s) * _ring_factor(workers)


def parameter_server_received_bytes(size_bytes: float, workers: int, servers: int = 1) -> float:
    """Bytes one parameter server receives per synchronous step: every worker pushes its gradients.

    With ``servers`` shards each takes 1/servers of every push; it sends as many bytes back (fresh weights).
    """
    return _count("workers", workers) * _non_negative("size_bytes", size_bytes) / _count("servers", servers)


def parameter_server_time_s(size_bytes: float, workers: int, bandwidth_bytes_per_s: float, servers: int = 1) -> float:
    """Communication time of a parameter-server step, bound by the server's link (full duplex: push and
    pull overlap). Grows with the number of workers, unlike a ring all-reduce."""
    received = parameter_server_received_bytes(size_bytes, workers, servers)
    return received / _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)


def synchronous_step_time_s(worker_times_s: Sequence[float]) -> float:
    """A synchronous step ends when the slowest worker is done: the maximum of the workers' times."""
    times = [_non_negative("worker_times_s", t) for t in _sequence("worker_times_s", worker_times_s)]
    return max(times)


def expected_staleness_updates(workers: int) -> int:
    """Updates that land between a worker reading the weights and its own update arriving, for
    ``workers`` equally fast asynchronous workers: the N-1 others each update once."""
    return _count("workers", workers) - 1


@dataclass(frozen=True)
class LatencyBandwidthFit:
    """Link parameters fitted from all-reduce timings."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def allreduce_time_s(self, size_bytes: float, workers: int) -> float:
        """The ring all-reduce time this fit predicts."""
        return ring_allreduce_time_s(size_bytes, workers, self.bandwidth_bytes_per_s, self.latency_s)


def fit_latency_bandwidth(measurements: Iterable[Sequence[float]], workers: int | None = None) -> LatencyBandwidthFit:
    """Fit latency ``a`` and bandwidth ``B`` of the ring model to measured all-reduce times.

    ``measurements`` holds ``(workers, size_bytes, time_s)`` triples, or ``(size_bytes, time_s)`` pairs
    when ``workers`` is given. The model ``T = 2(N-1)/N * S * (1/B) + (N-1) * a`` is linear in 1/B and a,
    so this is least squares on two unknowns; a fitted negative latency (noise on a fast link) is
    clamped to 0 and the bandwidth refitted alone.
    """
    rows: list[tuple[float, float, float]] = []  # (x_bandwidth, x_latency, time)
    for index, item in enumerate(measurements):
        values = list(_sequence(f"measurements[{index}]", item))
        if len(values) == 2 and workers is not None:
            values = [workers, *values]
        if len(values) != 3:
            shape = "(size_bytes, time_s)" if workers is not None else "(workers, size_bytes, time_s)"
            raise ValueError(f"measurements[{index}] must be {shape}, got {item!r}")
        n = _count(f"workers of measurements[{index}]", values[0], minimum=2)
        size = _non_negative(f"size_bytes of measurements[{index}]", values[1])
        time = _positive(f"time_s of measurements[{index}]", values[2])
        rows.append((_ring_factor(n) * size, n - 1.0, time))
    if len({(x, y) for x, y, _ in rows}) < 2:
        raise ValueError("need measurements at two or more different sizes to separate latency from bandwidth")

    sxx = sum(x * x for x, _, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    syt = sum(y * t for _, y, t in rows)
    det = sxx * syy - sxy * sxy
    if det <= 1e-12 * sxx * syy:
        # The sizes and world sizes move together, so no fit can tell latency from bandwidth.
        raise ValueError("latency and bandwidth cannot be separated: vary the size at a fixed number of workers")
    inverse_bandwidth = (sxt * syy - syt * sxy) / det
    latency = (sxx * syt - sxy * sxt) / det
    if latency < 0:
        latency, inverse_bandwidth = 0.0, (sxt / sxx if sxx else 0.0)
    if inverse_bandwidth <= 0:
        raise ValueError("the times do not grow with the size: measure larger buffers (e.g. 1 MB to 256 MB)")
    return LatencyBandwidthFit(latency_s=latency, bandwidth_bytes_per_s=1.0 / inverse_bandwidth)


def _sequence(name: str, value: object) -> Sequence[object]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a non-empty list of numbers, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

_PRECISIONS = ("fp32", "mixed")
_OPTIMIZERS = ("adam", "momentum", "sgd")


@dataclass(frozen=True)
class StateBytes:
    """Bytes each parameter costs in training, split the way ZeRO shards them."""

    weights: int
    gradients: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states


def state_bytes_per_parameter(precision: str = "mixed", optimizer: str = "adam") -> StateBytes:
    """Weights, gradients and optimizer states per parameter.

    ``precision="mixed"``: fp16/bf16 weights (2) and gradients (2), and an fp32 master copy (4) that the
    optimizer owns, so it counts with the optimizer states. ``"fp32"``: 4 and 4, no master copy.
    ``optimizer``: "adam" keeps m and v (4 + 4), "momentum" (SGD with momentum) one buffer (4), "sgd" none.
    """
    checks.choice("precision", precision, _PRECISIONS)
    checks.choice("optimizer", optimizer, _OPTIMIZERS)
    moments = {"adam": 8, "momentum": 4, "sgd": 0}[optimizer]
    if precision == "mixed":
        return StateBytes(weights=2, gradients=2, optimizer_states=4 + moments)
    return StateBytes(weights=4, gradients=4, optimizer_states=moments)


def bytes_per_parameter(precision: str = "mixed", optimizer: str = "adam") -> int:
    """Total training bytes per parameter: 16 for mixed-precision Adam (2 + 2 + 4 + 4 + 4)."""
    return state_bytes_per_parameter(precision, optimizer).total


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory one device needs, in bytes."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_states_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_states_bytes + self.activation_bytes


def memory_breakdown(
    parameters: float,
    devices: int = 1,
    zero_stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
    activation_bytes: float = 0.0,
) -> MemoryBreakdown:
    """Per-device memory of data-parallel training, plain DDP (``zero_stage=0``) or ZeRO stage 1-3.

    Stage 1 shards optimizer states over ``devices``, stage 2 gradients too, stage 3 (FSDP) the weights
    too. ``activation_bytes`` (activations and buffers of one device) are not sharded.
    """
    count = _non_negative("parameters", parameters)
    shards = _count("devices", devices)
    stage = _count("zero_stage", zero_stage, minimum=0)
    if stage > 3:
        raise ValueError(f"zero_stage must be 0 (plain DDP), 1, 2 or 3, got {zero_stage!r}")
    per = state_bytes_per_parameter(precision, optimizer)

    def share(bytes_each: int, sharded_from_stage: int) -> float:
        total = count * bytes_each
        return total / shards if stage >= sharded_from_stage else total

    return MemoryBreakdown(
        weights_bytes=share(per.weights, 3),
        gradients_bytes=share(per.gradients, 2),
        optimizer_states_bytes=share(per.optimizer_states, 1),
        activation_bytes=_non_negative("activation_bytes", activation_bytes),
    )


def memory_per_device_bytes(
    parameters: float,
    devices: int = 1,
    zero_stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
    activation_bytes: float = 0.0,
) -> float:
    """Total of :func:`memory_breakdown`: 2e9 parameters, mixed Adam -> 32 GB; ZeRO-3 over 8 -> 4 GB."""
    return memory_breakdown(parameters, devices, zero_stage, precision, optimizer, activation_bytes).total_bytes


def activation_bytes(micro_batch: int, sequence_length: int, hidden_size: int, bytes_per_element: int = 2) -> int:
    """Bytes of one [micro_batch, sequence_length, hidden_size] activation, the tensor a pipeline stage
    sends to the next (forward) and gets back as a gradient (backward)."""
    return (
        _count("micro_batch", micro_batch)
        * _count("sequence_length", sequence_length)
        * _count("hidden_size", hidden_size)
        * _count("bytes_per_element", bytes_per_element)
    )


# --------------------------------------------------------------------------------------------------
# Pipelines
# --------------------------------------------------------------------------------------------------


def pipeline_bubble_fraction(stages: int, micro_batches: int) -> float:
    """Share of a pipeline step the stages sit idle (GPipe schedule): ``(p-1) / (m+p-1)``."""
    p, m = _count("stages", stages), _count("micro_batches", micro_batches)
    return (p - 1) / (m + p - 1)


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
    """Expected weak-scaling efficiency of data parallelism: compute / (compute + exposed communication).

    ``overlap_fraction`` of the communication hides behind the backward pass (DDP's bucketing).
    """
    compute = _positive("compute_time_s", compute_time_s)
    exposed = _non_negative("comm_time_s", comm_time_s) * (1 - _fraction("overlap_fraction", overlap_fraction))
    return compute / (compute + exposed)


def speedup(time_one_worker_s: float, time_n_workers_s: float) -> float:
    """How many times faster N workers finish the same job than one."""
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
# Ranks and metrics
# --------------------------------------------------------------------------------------------------


def world_size(nodes: int, processes_per_node: int) -> int:
    """Ranks in the job, as torchrun counts them: nodes * processes per node."""
    return _count("nodes", nodes) * _count("processes_per_node", processes_per_node)


def global_rank(node_rank: int, local_rank: int, processes_per_node: int) -> int:
    """torchrun's RANK of a process: node_rank * processes_per_node + local_rank."""
    per_node = _count("processes_per_node", processes_per_node)
    local = _count("local_rank", local_rank, minimum=0)
    if local >= per_node:
        raise ValueError(f"local_rank must be below processes_per_node ({per_node}), got {local}")
    return _count("node_rank", node_rank, minimum=0) * per_node + local


def global_mean(sums: Sequence[float], counts: Sequence[float]) -> float:
    """The global mean from per-rank sums and counts (all-reduce both, then divide).

    Averaging the per-rank means instead is wrong when ranks saw different numbers of samples.
    """
    total_sum = sum(_number("sums", s) for s in _sequence("sums", sums))
    count_values = [_non_negative("counts", c) for c in _sequence("counts", counts)]
    if len(count_values) != len(sums):
        raise ValueError(f"give one count per sum: {len(sums)} sums, {len(count_values)} counts")
    total_count = sum(count_values)
    if total_count == 0:
        raise ValueError("counts add up to 0: there is no mean of zero samples")
    return total_sum / total_count


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
