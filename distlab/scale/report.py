"""What a dry run measured, as the notebook holds it: frozen dataclasses parsed from the dry run's JSON.

Pure Python (no torch). ``scale.dry_run`` returns a :class:`DryRunReport`; ``scale.predict`` reads it.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Literal, TypedDict, final

from .plan import Plan, PlanJSON

__all__ = [
    "MEMORY", "CollectiveCount", "CollectiveJSON", "DryRunJSON", "DryRunReport", "MemoryJSON", "MemoryKey", "RankKind",
    "RankKindJSON",
]

#: The memory categories of a rank kind, in bytes.
MemoryKey = Literal["parameters", "gradients", "optimizer", "activations", "peak"]
MEMORY: tuple[MemoryKey, ...] = ("parameters", "gradients", "optimizer", "activations", "peak")
_GIB = 2**30


class CollectiveJSON(TypedDict):
    """A :class:`CollectiveCount` in the dry run's JSON."""

    op: str
    dim: str
    group_size: int
    bytes: int
    calls_per_micro_batch: int
    phase: str


class _Memory(TypedDict):
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    peak: int


class MemoryJSON(_Memory, total=False):
    """A rank kind's bytes by :data:`MEMORY`, in the dry run's JSON; ``saved``: what one micro-batch's
    forward leaves for its backward (the dry run's own, for a pipeline's micro-batches in flight)."""

    saved: int


@final  # no other keys: a failed run's {"error": ...} is told apart by its key
class RankKindJSON(TypedDict):
    """A :class:`RankKind` in the dry run's JSON."""

    name: str
    ranks: int
    rank: int
    stage: int | None
    memory: MemoryJSON
    collectives: list[CollectiveJSON]
    flops_per_micro_batch: float
    recompute_flops_per_micro_batch: float
    fp8_flops_per_micro_batch: float
    attention_flops_per_micro_batch: float
    streamed_bytes_per_micro_batch: float
    fused_bytes_per_micro_batch: float
    dtensor_ops_per_micro_batch: float


class DryRunJSON(TypedDict):
    """The dry run's report as JSON (``python -m distlab.rank.dryrun``'s output; :class:`DryRunReport`'s source)."""

    plan: PlanJSON
    parameters: int
    kinds: list[RankKindJSON]
    seconds: float
    micro_batches: int
    tokens_per_step: int


@dataclass(frozen=True)
class CollectiveCount:
    """One kind of collective a rank runs, and how often.

    ``op``: "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", or a pipeline's
    "send" / "recv". ``dim``: the mesh dimension whose group it runs over ("dp_shard", "dp_replicate",
    "tp", "cp", "pp"). ``bytes``: the payload of one call on this rank, its input tensor (an all-gather's
    local shard, a reduce-scatter's whole input). ``calls_per_micro_batch``: calls in one micro-batch's
    forward and backward; for ``phase`` "optimizer" (collectives of the optimizer's step, none with
    FSDP2 or DDP) it is the calls of the whole step, which runs once per step, not per micro-batch.
    """

    op: str
    dim: str
    group_size: int
    bytes: int
    calls_per_micro_batch: int
    phase: str


@dataclass(frozen=True)
class RankKind:
    """Ranks that hold and do the same: all of them without pipeline parallelism, else the first, the
    middle and the last stages. ``rank``: the one run; ``stage``: its pipeline stage (None without pp).
    ``memory``: bytes by :data:`MEMORY` (``activations``: what a step holds beyond the parameters and
    optimizer states at its peak, for the micro-batches a pipeline stage holds at once; ``peak``: the
    most held at once). FLOPs: the model's for one micro-batch's forward and backward, and what
    activation checkpointing adds by recomputing."""

    name: str
    ranks: int
    rank: int
    stage: int | None
    memory: dict[str, int]
    collectives: list[CollectiveCount]
    flops_per_micro_batch: float
    recompute_flops_per_micro_batch: float
    #: Of the two above (model and recomputed), what fp8 matmuls run (``precision="fp8"``): the rest runs in bf16.
    fp8_flops_per_micro_batch: float = 0.0
    #: Of the same two, what attention kernels run (the rest: matmuls).
    attention_flops_per_micro_batch: float = 0.0
    #: The bytes every other kernel of forward and backward reads and writes, as eager torch runs them
    #: (norms, activations, casts, residual adds, FSDP's copies): memory-bound, timed at the memory's rate.
    streamed_bytes_per_micro_batch: float = 0.0
    #: What the same kernels move where a stack fuses each chain of them between two matmuls
    #: (torch.compile, Transformer Engine): what enters and leaves each chain, once.
    fused_bytes_per_micro_batch: float = 0.0
    #: Ops DTensor dispatched (tensor parallelism's), each with Python of its own on the host before its
    #: local kernels: a lab's CPU ranks wait for it (``Hardware.host_s_per_dtensor_op``).
    dtensor_ops_per_micro_batch: float = 0.0


@dataclass(frozen=True)
class DryRunReport:
    """A plan's dry run: each rank kind's memory, collectives and FLOPs, and how long the run took."""

    plan: Plan
    parameters: int
    kinds: list[RankKind]
    seconds: float
    micro_batches: int
    tokens_per_step: int

    @classmethod
    def from_json(cls, plan: Plan, data: DryRunJSON) -> DryRunReport:
        kinds = [
            RankKind(
                name=k["name"], ranks=int(k["ranks"]), rank=int(k["rank"]), stage=k["stage"],
                memory={key: int(k["memory"][key]) for key in MEMORY},
                collectives=[CollectiveCount(**c) for c in k["collectives"]],
                flops_per_micro_batch=float(k["flops_per_micro_batch"]),
                recompute_flops_per_micro_batch=float(k["recompute_flops_per_micro_batch"]),
                fp8_flops_per_micro_batch=float(k.get("fp8_flops_per_micro_batch", 0.0)),
                attention_flops_per_micro_batch=float(k.get("attention_flops_per_micro_batch", 0.0)),
                streamed_bytes_per_micro_batch=float(k.get("streamed_bytes_per_micro_batch", 0.0)),
                fused_bytes_per_micro_batch=float(k.get("fused_bytes_per_micro_batch", 0.0)),
                dtensor_ops_per_micro_batch=float(k.get("dtensor_ops_per_micro_batch", 0.0)),
            )
            for k in data["kinds"]
        ]
        return cls(plan, int(data["parameters"]), kinds, float(data["seconds"]), int(data["micro_batches"]),
                   int(data["tokens_per_step"]))

    def by_dimension(self, kind: RankKind) -> dict[str, list[CollectiveCount]]:
        """``kind``'s collectives grouped by mesh dimension."""
        found: dict[str, list[CollectiveCount]] = {}
        for c in kind.collectives:
            found.setdefault(c.dim, []).append(c)
        return found

    def _title(self) -> str:
        p = self.plan
        return (f"{p.config.name} on {p.gpus} GPUs (dp {p.dp_degree} {p.dp}, tp {p.tp}, pp {p.pp}, cp {p.cp}), "
                f"{self.parameters:,} parameters, {self.micro_batches} micro-batches of {p.micro_batch_size} x "
                f"{p.seq_len} tokens per step: dry run in {self.seconds:.1f} s")

    def _rows(self) -> list[list[str]]:
        return [[k.name, str(k.ranks), *(f"{k.memory[m] / _GIB:.2f}" for m in MEMORY)] for k in self.kinds]

    def _collective_lines(self, kind: RankKind) -> list[str]:
        lines = []
        for dim, found in self.by_dimension(kind).items():
            parts = [f"{c.calls_per_micro_batch} x {c.op} {c.bytes / 2**20:.1f} MiB ({c.phase})" for c in found]
            lines.append(f"  {dim} (groups of {found[0].group_size}): " + ", ".join(parts))
        return lines

    def __str__(self) -> str:
        head = ["rank kind", "ranks", *(f"{m} GiB" for m in MEMORY)]
        rows = [head, *self._rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        table = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        lines = [self._title(), *table]
        for k in self.kinds:
            lines.append(f"{k.name}: {k.flops_per_micro_batch / 1e12:.1f} TFLOP per micro-batch"
                         f" (+{k.recompute_flops_per_micro_batch / 1e12:.1f} recomputed); collectives per micro-batch:")
            lines += self._collective_lines(k)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in ["rank kind", "ranks", *(f"{m} (GiB)" for m in MEMORY)])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self._rows())
        parts = [f"<p>{html.escape(self._title())}</p>", f"<table><tr>{head}</tr>{body}</table>"]
        for k in self.kinds:
            items = "".join(f"<li>{html.escape(line.strip())}</li>" for line in self._collective_lines(k))
            title = f"{html.escape(k.name)}: collectives per micro-batch, by mesh dimension"
            parts.append(f"<p>{title}</p><ul>{items}</ul>")
        return "".join(parts)
