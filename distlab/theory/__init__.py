"""Cost models of distributed training, as plain functions.

Every quiz answer, dashboard estimate and notebook figure that is a number comes from here, so the
formulas live in one place. Names carry their units: a function ending in ``_s`` returns seconds,
``_bytes`` returns bytes, ``_bytes_per_s`` returns bytes per second; arguments are named the same way
(``size_bytes``, ``bandwidth_bytes_per_s``, ``latency_s``). Everything is in base units (bytes,
seconds); :func:`to_base_units` and :func:`parse_quantity` convert from "400 MB" or "5 us".

Bad arguments raise :class:`ValueError` with a message that names the argument and the fix.

The models live in modules by subject; every public name is here, so ``theory.X`` and
``from distlab.theory import X`` do not depend on which module holds X:

    units           units and quantities ("400 MB" -> bytes), the dimension a name's suffix carries
    batch           global batch and learning rate, each rank's share of the data, ranks and global means
    communication   ring all-reduce, compiled DDP's graphs, bus bandwidth, parameter server, latency and
                    bandwidth fitted
    collectives     bytes each rank sends and receives per collective, their time, busbw factors
    algorithms      the algorithm NCCL runs a collective with (ring, tree, NVLS, PAT) and its time
    memory          bytes per parameter, per-device memory under DDP and ZeRO, activation sizes
    sharding        memory per device under DDP, ZeRO-1/2/3, FSDP2 with TP and PP; bytes moved per step
    transformer     a GPT-2-style model's parameters, training FLOPs per token, MFU, activations per layer
    pipeline        bubbles of GPipe, 1F1B and interleaved schedules, activations in flight, torch's order
    scaling         speed-up and efficiency, training time, fault tolerance (and the GPipe bubble)
    plan            a training plan checked against the models: memory, time, learning rate, metrics
"""

from __future__ import annotations

from .algorithms import ALGORITHMS, AlgorithmTime, algorithm_times, nccl_collective_time_s
from .batch import (
    accumulation_steps_for,
    global_batch_size,
    global_mean,
    global_rank,
    sampler_padding_samples,
    samples_per_rank,
    scaled_learning_rate,
    steps_per_epoch,
    world_size,
)
from .collectives import CollectiveBytes, bus_bandwidth_factor, collective_bytes, collective_time_s
from .communication import (
    LatencyBandwidthFit,
    algbw_bytes_per_s,
    asynchronous_run_time_s,
    bucketed_allreduce_time_s,
    busbw_bytes_per_s,
    compiled_ddp_graph_bytes,
    compiled_ddp_graphs,
    expected_staleness_updates,
    fit_latency_bandwidth,
    overlapped_backward_time_s,
    parameter_server_received_bytes,
    parameter_server_time_s,
    ring_allreduce_sent_bytes,
    ring_allreduce_time_s,
    synchronous_run_time_s,
    synchronous_step_time_s,
    worker_staleness_updates,
)
from .memory import (
    MemoryBreakdown,
    StateBytes,
    activation_bytes,
    bytes_per_parameter,
    memory_breakdown,
    memory_per_device_bytes,
    state_bytes_per_parameter,
)
from .pipeline import (
    bubble_fraction,
    bubble_ratio,
    in_flight_micro_batches,
    pipeline_schedule,
    pipeline_step_time_s,
    pipeline_timeline,
)
from .plan import PlanCheck, PlanReport, TrainingJob, check_plan, communication_per_step_s
from .scaling import (
    amdahl_speedup,
    cluster_mtbf_s,
    compute_comm_ratio,
    epoch_time_s,
    expected_scaling_efficiency,
    lost_work_s,
    micro_batches_for_bubble,
    optimal_checkpoint_interval_s,
    parallel_efficiency,
    pipeline_bubble_fraction,
    speedup,
    strong_scaling_speedup,
    training_time_s,
    weak_scaling_efficiency,
)
from .sequence import causal_load_imbalance, expert_capacity, ring_attention_pairs
from .sharding import (
    ShardedMemory,
    averaged_step_time_s,
    ddp_bytes_per_step,
    fsdp_bytes_per_step,
    fsdp_padded_shard_bytes,
    fsdp_shard_rows,
    local_sgd_bytes_per_step,
    pipeline_bytes_per_step,
    received_logits_bytes,
    sharded_memory,
    tensor_parallel_bytes_per_step,
)
from .topology import fsdp_uplink_bytes_per_step, ring_edge_bandwidths, ring_uplink_crossings, tiered_allreduce_time_s
from .transformer import (
    TransformerShape,
    activation_bytes_per_layer,
    model_flops_utilization,
    training_flops_per_token,
)
from .units import DIMENSIONS, UNITS, dimension_of, from_base_units, parse_quantity, to_base_units, unit_dimension

__all__ = [
    "ALGORITHMS",
    "DIMENSIONS",
    "UNITS",
    "AlgorithmTime",
    "CollectiveBytes",
    "LatencyBandwidthFit",
    "MemoryBreakdown",
    "PlanCheck",
    "PlanReport",
    "ShardedMemory",
    "StateBytes",
    "TrainingJob",
    "TransformerShape",
    "accumulation_steps_for",
    "activation_bytes",
    "activation_bytes_per_layer",
    "algbw_bytes_per_s",
    "algorithm_times",
    "amdahl_speedup",
    "asynchronous_run_time_s",
    "averaged_step_time_s",
    "bubble_fraction",
    "bubble_ratio",
    "bucketed_allreduce_time_s",
    "bus_bandwidth_factor",
    "busbw_bytes_per_s",
    "bytes_per_parameter",
    "causal_load_imbalance",
    "check_plan",
    "cluster_mtbf_s",
    "collective_bytes",
    "collective_time_s",
    "communication_per_step_s",
    "compiled_ddp_graph_bytes",
    "compiled_ddp_graphs",
    "compute_comm_ratio",
    "ddp_bytes_per_step",
    "dimension_of",
    "epoch_time_s",
    "expected_scaling_efficiency",
    "expected_staleness_updates",
    "expert_capacity",
    "fit_latency_bandwidth",
    "from_base_units",
    "fsdp_bytes_per_step",
    "fsdp_padded_shard_bytes",
    "fsdp_shard_rows",
    "fsdp_uplink_bytes_per_step",
    "global_batch_size",
    "global_mean",
    "global_rank",
    "in_flight_micro_batches",
    "local_sgd_bytes_per_step",
    "lost_work_s",
    "memory_breakdown",
    "memory_per_device_bytes",
    "micro_batches_for_bubble",
    "model_flops_utilization",
    "nccl_collective_time_s",
    "optimal_checkpoint_interval_s",
    "overlapped_backward_time_s",
    "parallel_efficiency",
    "parameter_server_received_bytes",
    "parameter_server_time_s",
    "parse_quantity",
    "pipeline_bubble_fraction",
    "pipeline_bytes_per_step",
    "pipeline_schedule",
    "pipeline_step_time_s",
    "pipeline_timeline",
    "received_logits_bytes",
    "ring_allreduce_sent_bytes",
    "ring_allreduce_time_s",
    "ring_attention_pairs",
    "ring_edge_bandwidths",
    "ring_uplink_crossings",
    "sampler_padding_samples",
    "samples_per_rank",
    "scaled_learning_rate",
    "sharded_memory",
    "speedup",
    "state_bytes_per_parameter",
    "steps_per_epoch",
    "strong_scaling_speedup",
    "synchronous_run_time_s",
    "synchronous_step_time_s",
    "tensor_parallel_bytes_per_step",
    "tiered_allreduce_time_s",
    "to_base_units",
    "training_flops_per_token",
    "training_time_s",
    "unit_dimension",
    "weak_scaling_efficiency",
    "worker_staleness_updates",
    "world_size",
]
