"""What a watched rank publishes and the notebook reads, declared once for both sides.

The ranks (``distlab.telemetry``) build these dicts and the notebook (``distlab.dashboard``, the
lab's side-panel summary) reads them; they meet only as data sent through ipyparallel's
``publish_data``. Both import this module, so it imports neither torch nor ipyparallel.
The types are ``TypedDict``s: at run time every record is a plain dict (``lab.telemetry.records()``
is a list of dicts), and ``tests/test_records.py`` checks that what the ranks really emit has
exactly these keys.
"""

from __future__ import annotations

from typing import NamedTuple, TypedDict

__all__ = [
    "PUBLISH_KEY",
    "AllReduceBucket",
    "Collective",
    "LayerChecksums",
    "LayerValues",
    "Layout",
    "MemoryUse",
    "Publish",
    "RecordKey",
    "SampledEvery",
    "StepRecord",
    "WatchMeta",
    "record_key",
]

#: The key of distlab's telemetry in a rank's ``publish_data`` (``AsyncResult.data`` on the client).
PUBLISH_KEY = "distlab.telemetry"

#: {layer: value}: a number per layer, the layers named as in ``WatchMeta["layers"]``.
LayerValues = dict[str, float]
#: {layer: exact checksum of its weights' bits}.
LayerChecksums = dict[str, int]


class _BucketTiming(TypedDict):
    bucket: int  # the step's n-th all-reduce: DDP's bucket n (it launches them in index order)
    bytes: int
    seconds: float  # launch to completion
    start_s: float  # launch, from the step's forward


class AllReduceBucket(_BucketTiming, total=False):
    """One timed all-reduce of a step. The bandwidths are there when ``seconds`` > 0."""

    algbw: float  # bytes / seconds
    busbw: float  # algbw scaled by the ring's traffic: comparable across world sizes


class _CollectiveTiming(TypedDict):
    op: str  # "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send", ...
    bytes: int  # as distlab.theory.collective_bytes counts them: the whole tensor (a reduce-scatter's input,
    # an all-gather's output)
    ranks: int  # the size of the group it ran over
    seconds: float  # launch to completion
    start_s: float  # launch, from the step's forward


class Collective(_CollectiveTiming, total=False):
    """One collective of a step seen op by op (FSDP2, DTensor, by hand). Bandwidths when ``seconds`` > 0."""

    algbw: float
    busbw: float  # algbw scaled by the op's ring traffic (distlab.theory.bus_bandwidth_factor)
    layer: str  # the layer it gathers or reduces, where known (FSDP2's units, named as in WatchMeta["layers"])
    untimed: bool  # True for a send or receive on gloo: its bytes are known, its time is not (seconds 0)


class MemoryUse(TypedDict):
    """What one rank holds at the end of a step, and the most it held during it (bytes, local shards)."""

    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    #: parameters + gradients + optimizer state at the step's start, plus the most bytes of tensors
    #: made during the step alive at once (CUDA: torch's allocator peak; CPU: live tensors counted).
    peak_bytes: int


class StepRecord(TypedDict):
    """One rank's record of one training step (see ``distlab.telemetry.watch``)."""

    rank: int
    step: int
    t: float  # wall clock (time.time) at the step's forward
    epoch: int | None
    loss: float | None
    metrics: dict[str, float]  # what distlab.log got besides loss and epoch
    step_time_s: float  # forward -> update
    compute_s: float  # step_time_s - comm_s
    comm_s: float  # DDP: exposed all-reduce, what the step waited for after backward; others: time with a
    # collective in flight
    idle_s: float | None  # before the forward, since the previous update (None on the first step)
    allreduce: list[AllReduceBucket]  # DDP's buckets
    collectives: list[Collective]  # every other collective of the step (FSDP2, tensor parallel, by hand), and
    # those after its update, before the next step (averaging models every H steps): start_s past step_time_s
    memory: MemoryUse | None  # None when the watch does not track memory
    grad_norm: LayerValues  # sampled steps only (stats_every), else {}
    weight_norm: LayerValues
    update_ratio: LayerValues
    checksum: int | None  # sampled steps only (checksum_every), else None
    layer_checksums: LayerChecksums | None


class SampledEvery(TypedDict):
    """The watch's sampling settings, as the notebook needs them."""

    stats_every: int
    checksum_every: int
    publish_interval_s: float


class Layout(TypedDict):
    """A watched model's configuration, as ``distlab.theory.sharded_memory`` takes it (fp32 weights)."""

    parameters: int  # the whole model's
    strategy: str  # "ddp", "zero1", "fsdp2"
    data_parallel: int
    tensor_parallel: int
    precision: str
    optimizer: str  # "adam", "momentum", "sgd"


class WatchMeta(TypedDict):
    """What a rank's watch says about itself besides its steps."""

    rank: int
    world_size: int
    run: str  # one watch on one rank: a new run starts its steps afresh
    ddp: bool
    layers: list[str]
    sharded_layers: list[str]  # layers whose parameters are sharded across ranks: norms and checksums of shards
    replicated: bool  # False: each rank's weights are its own (watch(..., replicated=False)), no replicas
    grad_bytes: int  # one step's gradients: what a data-parallel step all-reduces
    initial_checksums: LayerChecksums
    timed: bool  # all-reduce buckets timed
    memory: str | None  # how memory is measured ("cuda", "cpu: live tensors"), None: not tracked
    layout: Layout | None  # None until the first update, or for a configuration the theory has no model of
    config: SampledEvery
    notes: list[str]  # why something is not measured, in words
    closed: bool


class Publish(TypedDict):
    """One publish of one rank: an overlapping window of its latest steps (all of them when final)."""

    run: str
    rank: int
    seq: int  # counts this run's publishes from 1
    final: bool
    meta: WatchMeta
    records: list[StepRecord]


class RecordKey(NamedTuple):
    """What identifies a record, in the order records are shown: by step, then by rank."""

    step: int
    rank: int


def record_key(record: StepRecord) -> RecordKey:
    """The record's identity: one record per rank and step (a later copy of it replaces it)."""
    return RecordKey(record["step"], record["rank"])
