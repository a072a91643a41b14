"""Sharding: what one device holds under DDP, ZeRO-1/2/3 and FSDP2, with tensor and pipeline parallelism
dividing the model first, and the bytes each kind of parallelism moves per step.

Sources: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (memory and traffic of the stages); Shoeybi et al. 2019, "Megatron-LM" (tensor parallelism);
Korthikanti et al. 2022 (sequence parallelism). Bytes per parameter are :mod:`memory`'s layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks
from ._checks import checked_count, checked_non_negative
from .collectives import collective_bytes
from .memory import activation_bytes, memory_breakdown, state_bytes_per_parameter

# --------------------------------------------------------------------------------------------------
# Memory per device
# --------------------------------------------------------------------------------------------------

#: strategy -> ZeRO stage: which states it shards over the data-parallel ranks.
STRATEGIES: dict[str, int] = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}


@dataclass(frozen=True)
class ShardedMemory:
    """Bytes of model states one device holds between steps, and what a step adds on top.

    ``offloaded_bytes``: the states kept in host memory instead (``cpu_offload``).
    """

    parameters_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    peak_extra_bytes: float
    offloaded_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        """Resident between steps: parameters + gradients + optimizer states."""
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> float:
        """Resident plus what the step adds (activations not included)."""
        return self.total_bytes + self.peak_extra_bytes


def sharded_memory(
    parameters: float,
    strategy: str,
    data_parallel: int,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    precision: str = "mixed",
    optimizer: str = "adam",
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    largest_unit_parameters: float | None = None,
) -> ShardedMemory:
    """Model-state memory per device. Tensor and pipeline parallelism divide the model first
    (parameters / (t * p)); then ``strategy`` shards over the ``data_parallel`` ranks (N):

    * ``"ddp"``: nothing sharded; ``"zero1"``: optimizer states / N; ``"zero2"``: gradients too;
    * ``"zero3"`` and ``"fsdp2"``: parameters too. Mixed-precision Adam (K = 12): DDP (2 + 2 + K) Psi,
      ZeRO-1 (2 + 2 + K/N) Psi, ZeRO-2 (2 + (2 + K)/N) Psi, ZeRO-3 (2 + 2 + K) Psi / N.

    ``precision`` and ``optimizer`` pick the bytes per parameter (:func:`state_bytes_per_parameter`).

    ``peak_extra_bytes`` is what the step adds for whole parameters (ZeRO-3 / FSDP2 only; the others
    hold them whole already): the all-gathered units, at the bytes of the layout's weights. With
    ``reshard_after_forward`` (FSDP2's default) each unit is freed after use: the one computing and
    the one prefetched, 2 * ``largest_unit_parameters`` (None: the model is one unit, all of it).
    Without it, parameters gathered in forward stay whole until backward: at the end of forward the
    whole model is (ZeRO-2-like at the peak). Gradients of a unit before their reduce-scatter and
    communication buckets are not counted.

    ``cpu_offload`` (ZeRO-3 / FSDP2, FSDP2's ``CPUOffloadPolicy``): the sharded parameters, gradients
    and optimizer states live in host memory; the device keeps only the gathered units.
    """
    stage = STRATEGIES[checks.choice("strategy", strategy, tuple(STRATEGIES))]
    n = checked_count("data_parallel", data_parallel)
    tp = checked_count("tensor_parallel", tensor_parallel)
    model_split = tp * checked_count("pipeline_parallel", pipeline_parallel)
    local = checked_non_negative("parameters", parameters) / model_split
    checks.flag("reshard_after_forward", reshard_after_forward)
    checks.flag("cpu_offload", cpu_offload)
    if cpu_offload and stage < 3:
        raise ValueError(f"cpu_offload applies to zero3 and fsdp2 (FSDP2's CPUOffloadPolicy), not {strategy}")
    states = memory_breakdown(local, n, stage, precision, optimizer)
    resident = ShardedMemory(states.weights_bytes, states.gradients_bytes, states.optimizer_states_bytes, 0.0)

    peak_extra = 0.0
    if stage == 3:
        whole = local  # parameters of this device's part of the model
        if reshard_after_forward and largest_unit_parameters is not None:
            unit = checked_non_negative("largest_unit_parameters", largest_unit_parameters) / model_split
            whole = min(2 * unit, local)  # the unit computing and the one prefetched
        peak_extra = whole * state_bytes_per_parameter(precision, optimizer).weights
    if cpu_offload:
        return ShardedMemory(0.0, 0.0, 0.0, peak_extra, offloaded_bytes=resident.total_bytes)
    return ShardedMemory(resident.parameters_bytes, resident.gradients_bytes, resident.optimizer_bytes, peak_extra)


# --------------------------------------------------------------------------------------------------
# Communication per step
# --------------------------------------------------------------------------------------------------


def _activation(micro_batch: int, seq_len: int, hidden: int, bytes_per_element: int) -> int:
    # memory.activation_bytes, with the arguments checked under this module's names.
    return activation_bytes(
        checked_count("micro_batch", micro_batch),
        checked_count("seq_len", seq_len),
        checked_count("hidden", hidden),
        checked_count("bytes_per_element", bytes_per_element),
    )


def fsdp_shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a parameter's first dimension that rank ``rank``'s FSDP2 shard holds: torch.chunk's
    split, chunks of ``ceil(rows / world_size)`` from rank 0 until the rows run out, so that the later
    ranks may hold fewer or none (128,256 rows over 1,024 ranks: 126 each, 114 on rank 1,017, none on
    the last six). torch/distributed/fsdp/_fully_shard/_fsdp_param.py: ``torch.chunk(..., world_size)``."""
    n = checked_count("rows", rows, minimum=0)
    w = checked_count("world_size", world_size)
    r = checked_count("rank", rank, minimum=0)
    if r >= w:
        raise ValueError(f"rank must be below world_size ({w}), got {rank!r}")
    chunk = -(-n // w)
    return max(0, min(chunk, n - r * chunk))


def fsdp_padded_shard_bytes(rows: int, row_elements: int, world_size: int, bytes_per_element: int = 4) -> int:
    """Bytes every rank allocates for its FSDP2 shard of a parameter of ``rows`` rows of ``row_elements``
    each: the shard is padded to the full chunk, ``ceil(rows / world_size)`` rows, on every rank (an
    all-gather takes inputs of one size), whatever it really holds (:func:`fsdp_shard_rows`)."""
    n = checked_count("rows", rows, minimum=0)
    w = checked_count("world_size", world_size)
    row_bytes = checked_count("row_elements", row_elements) * checked_count("bytes_per_element", bytes_per_element)
    return -(-n // w) * row_bytes


def ddp_bytes_per_step(gradients_bytes: float, world_size: int) -> float:
    """Bytes each rank sends per step in DDP: one ring all-reduce of the gradients, 2(N-1)/N * Psi.
    The ZeRO paper's ZeRO-1 and ZeRO-2 move the same (reduce-scatter of gradients, all-gather of
    parameters); PyTorch's ``ZeroRedundancyOptimizer`` under DDP keeps the all-reduce and adds a
    broadcast of each rank's updated shard, (N-1)/N * Psi more."""
    return collective_bytes("all_reduce", gradients_bytes, world_size).sent_bytes


def local_sgd_bytes_per_step(parameters_bytes: float, world_size: int, interval: int = 1) -> float:
    """Bytes each rank sends per step when the models are averaged every ``interval`` steps (local SGD,
    DiLoCo): one ring all-reduce of the parameters every H steps, ``2(N-1)/N * Psi / H``. At H = 1
    it is DDP's (parameters and gradients have the same size)."""
    return ddp_bytes_per_step(parameters_bytes, world_size) / checked_count("interval", interval)


def averaged_step_time_s(compute_s: float, allreduce_s: float, interval: int = 1) -> float:
    """A step's time, on average, when the models are averaged every ``interval`` steps (local SGD,
    DiLoCo) by one all-reduce taking ``allreduce_s``, the step's compute taking ``compute_s`` and
    nothing overlapping them: ``compute + allreduce / H``. At H = 1 it is DDP's step with its gradients'
    all-reduce in one bucket at the end of the backward pass (nothing to hide it behind)."""
    compute = checked_non_negative("compute_s", compute_s)
    allreduce = checked_non_negative("allreduce_s", allreduce_s)
    return compute + allreduce / checked_count("interval", interval)


def received_logits_bytes(
    tokens: float, vocab_size: int, tp: int, bytes_per_value: float = 4.0, loss_parallel: bool = False
) -> float:
    """Bytes each rank of a tensor-parallel group of ``tp`` receives to take the cross-entropy of ``tokens``
    tokens when the output layer is split by vocabulary (column-wise), each rank holding ``vocab_size / tp``
    of every token's logits.

    Gathered first (``ColwiseParallel`` with a replicated output): an all-gather of the whole
    ``tokens x vocab_size`` logits, ``(tp-1)/tp`` of it received. With loss parallelism (torch's
    ``loss_parallel``): the cross-entropy is computed on the shards, with three all-reduces of one value
    a token (the largest logit, the sum of exponentials, the target's logit), ``2(tp-1)/tp`` of each.
    Values of ``bytes_per_value`` bytes either way."""
    n_tokens = checked_non_negative("tokens", tokens)
    vocab = checked_count("vocab_size", vocab_size)
    n = checked_count("tp", tp)
    value = checked_non_negative("bytes_per_value", bytes_per_value)
    checks.flag("loss_parallel", loss_parallel)
    if loss_parallel:
        return 3 * collective_bytes("all_reduce", n_tokens * value, n).received_bytes
    return collective_bytes("all_gather", n_tokens * vocab * value, n).received_bytes


def fsdp_bytes_per_step(parameters_bytes: float, world_size: int, reshard_after_forward: bool = True) -> float:
    """Bytes each rank sends per step in ZeRO-3 / FSDP: all-gather the parameters for forward, again for
    backward (they were resharded), reduce-scatter the gradients: 3(N-1)/N * Psi, 1.5x DDP. Without
    ``reshard_after_forward`` the backward all-gather is skipped: 2(N-1)/N * Psi, as DDP.
    Psi = ``parameters_bytes``, gradients reduced at the parameters' size."""
    checks.flag("reshard_after_forward", reshard_after_forward)
    gather = collective_bytes("all_gather", parameters_bytes, world_size).sent_bytes
    scatter = collective_bytes("reduce_scatter", parameters_bytes, world_size).sent_bytes
    return gather * (2 if reshard_after_forward else 1) + scatter


def tensor_parallel_bytes_per_step(
    micro_batch: int,
    seq_len: int,
    hidden: int,
    layers: int,
    tensor_parallel: int,
    bytes_per_element: int = 2,
    sequence_parallel: bool = False,
) -> float:
    """Bytes each tensor-parallel rank sends for one micro-batch's forward and backward (Megatron-LM):
    per layer, 2 all-reduces in forward (after attention, after the MLP) and 2 in backward, each of
    the b * s * h activation: ``layers * 4 * 2(t-1)/t * bsh`` elements. With ``sequence_parallel`` each
    all-reduce becomes an all-gather and a reduce-scatter, the same bytes (Korthikanti et al. 2022).
    Full recomputation repeats the forward's two all-reduces."""
    checks.flag("sequence_parallel", sequence_parallel)
    activation = _activation(micro_batch, seq_len, hidden, bytes_per_element)
    n_layers = checked_count("layers", layers)
    tensor_parallel = checked_count("tensor_parallel", tensor_parallel)
    if sequence_parallel:
        one = (
            collective_bytes("all_gather", activation, tensor_parallel).sent_bytes
            + collective_bytes("reduce_scatter", activation, tensor_parallel).sent_bytes
        )
    else:
        one = collective_bytes("all_reduce", activation, tensor_parallel).sent_bytes
    return n_layers * 4 * one


def pipeline_bytes_per_step(
    micro_batch: int, seq_len: int, hidden: int, micro_batches: int, bytes_per_element: int = 2
) -> float:
    """Bytes crossing one stage boundary per step, both ways: each micro-batch's b * s * h activation
    forward and its gradient backward, ``2 * m * bsh * bytes_per_element``. A middle stage sends (and
    receives) this much; the first and last stages half of it."""
    activation = _activation(micro_batch, seq_len, hidden, bytes_per_element)
    return 2 * checked_count("micro_batches", micro_batches) * activation
