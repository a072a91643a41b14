"""A plan's step time, tokens per second, MFU and memory per GPU, predicted from its dry run.

    report = scale.dry_run(plan)
    pred = scale.predict(plan, hardware="h100-sxm", network="ib-400g", report=report)

Everything counted comes from the dry run of the real code (``scale.dry_run``): each rank kind's
FLOPs per micro-batch (and what activation checkpointing recomputes), its memory by category, and
every collective with its bytes and the mesh dimension it runs on. The predictor adds the machine
(``hardware.py``) and a stated model of time:

- **Compute**, by kind of kernel (``Hardware.kernel_rates``, each rate from a published kernel
  benchmark of the part): the matmuls' FLOPs at the matmul rate of their precision's peak (fp8's at
  the fp8 peak), attention's at flash attention's rate (its kernels compute the causal half of the
  square that the count holds), and the bytes the memory-bound kernels read and write (norms,
  activations, casts, residual adds: one kernel an op as eager torch runs them, or each chain of them
  between two matmuls fused, ``Plan.fused_kernels``) at the memory's bandwidth; their sum
  over ``efficiency``, the one number not counted: the share of the kernels' own time a framework's
  step reaches (launches, waits, kernels too small for their rate). Each H100 profile has its own,
  fitted on one published run of that part (``Hardware.efficiency_source``; ``benchmarks/
  bench_published_runs.py --fit``) and tested on the others; a part with none takes the H100 SXM's
  (``EFFICIENCY``) and the prediction says so. A lab's profile (``scale.calibrate``) has no kernel
  rates: its FLOPs run at its measured fraction of its peak.
- **Where a collective runs**: the mesh is laid out as torchtitan lays it, ``(pp, dp_replicate,
  dp_shard, cp, tp)`` with tp innermost, consecutive ranks on a node. A dimension's group whose
  ranks all sit in one node uses the node's link (NVLink), else the network (each GPU's NIC, the
  ring's bottleneck). On a GPU profile (``Hardware.nccl``) each collective costs what the algorithm
  NCCL would pick costs (``theory.algorithm_times``: ring, tree, NVLS inside an NVSwitch node, PAT
  across one rank per node), given how many of the group's ranks share a node; ``Prediction.algorithms``
  says which ran. On a lab's calibrated profile (gloo), ``theory.collective_time_s`` (the ring model).
- **Overlap**: tensor-parallel collectives sit in the forward and backward's critical path: exposed
  in full. FSDP's all-gathers and reduce-scatters (and HSDP's or DDP's all-reduces) run beside
  compute (FSDP2 prefetches the next unit): exposed is what exceeds the compute they hide behind,
  plus one call (the first all-gather and the last reduction wait for nothing). Where the hardware
  overlaps only partly (``Hardware.overlap`` below 1: a CPU lab, whose cores run both), compute
  hides that share of its own time. Context-parallel
  exchanges overlap attention (torch's ring attention) the same way; a ring's step ("permute": all its
  bytes to one neighbour) costs a send. Under cp, FSDP shards over dp_shard and cp at once
  ("dp_shard_cp", torchtitan's), a group of shard x cp ranks tp apart. A pipeline's sends and receives
  are exposed, once per micro-batch per stage boundary.
- **Pipeline**: ``theory.pipeline_step_time_s`` of the slowest stage's micro-batch time: the bubble
  of the plan's schedule, ``(p-1)/(m+p-1)`` (1F1B, GPipe) or ``(p-1)/(v m+p-1)`` (interleaved).
  With uneven stages (``Plan.layers_per_stage``: Llama 3 405B's first and last stages one layer
  short), ``m * t_max + (sum of every pipeline rank's t - t_max) / v``: the slowest rank paces the
  micro-batches, every other fills and drains the pipeline once (for equal stages, the same).
  FSDP's collectives under a pipeline run once a step, not per micro-batch (torch's schedules keep
  the parameters gathered and reduce the gradients after the last micro-batch): its all-gathers hide
  behind the first micro-batch as above, its gradients' reduction is exposed after the last
  ("exposed dp_shard (once a step)"), with the collectives of the optimizer's phase.
- **Optimizer step**: AdamW reads and writes each local parameter, gradient and both moments once:
  bytes / the memory's bandwidth.

Memory per GPU is the dry run's peak of the hungriest rank kind (what the allocator holds at once);
a real job also holds the CUDA context, NCCL's buffers and the caching allocator's slack (several
GiB), which the published-runs table shows as the gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..theory import algorithm_times, collective_time_s, pipeline_step_time_s
from .compute import compute_s, kernel_s
from .hardware import SXM_FIT, Hardware, Network, hardware_named, network_named

if TYPE_CHECKING:
    from .plan import Plan
    from .report import CollectiveCount, DryRunReport, RankKind

__all__ = ["EFFICIENCY", "MESH_ORDER", "Prediction", "fit_note", "predict", "predict_report", "ranks_per_node"]

#: What a step's compute reaches of its kernels' own time (see the module) where a part has no fit of its
#: own: the H100 SXM's (``hardware.SXM_FIT``, fitted on a published run of NVIDIA's).
EFFICIENCY = SXM_FIT[0]

#: The device mesh's dimensions, outermost first (torchtitan's ParallelDims order): tp is innermost.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

_OVERLAPPED = {"dp_shard", "dp_replicate", "cp", "dp_shard_cp", "dp_cp"}
_ONCE_UNDER_PIPELINE = {"dp_shard", "dp_replicate", "dp_shard_cp", "dp_cp"}
_COLLECTIVE_OPS = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"}


@dataclass(frozen=True)
class Prediction:
    """What a plan does on a machine, per step and per GPU, and where the time goes (seconds)."""

    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float  # model FLOPs (no recompute) per second per GPU, over the peak
    memory_per_gpu_bytes: float
    #: compute, exposed communication by dimension, the bubble, the optimizer step: they add up to the step.
    breakdown: dict[str, float] = field(default_factory=dict)
    #: Each mesh dimension's link: "node" (NVLink), "network" or "none" (size 1).
    links: dict[str, str] = field(default_factory=dict)
    hardware: str = ""
    network: str = ""
    efficiency: float = EFFICIENCY
    #: Where ``efficiency`` came from: passed, measured on a lab, or the run it was fitted on (and on
    #: which part, where that is not the part predicted).
    efficiency_source: str = ""
    #: The compute of the step's slowest rank kind by kind of kernel (matmuls, attention, memory-bound),
    #: each at its rate and over the efficiency: they add up to ``breakdown["compute"]``. Empty on a
    #: lab's profile, whose compute is FLOPs at its peak.
    compute_by_kernel: dict[str, float] = field(default_factory=dict)
    #: The GPU's memory (0: not known) and, where the plan does not fit in it, one line saying by how
    #: much and what takes the room.
    memory_limit_bytes: float = 0.0
    fit_note: str = ""
    #: The algorithm each dimension's collectives ran with, by "dimension op" (``"dp_shard all_gather":
    #: "pat"``; two joined by "/" where calls of different sizes ran with different ones). Empty on a
    #: lab's profile, whose collectives are rings.
    algorithms: dict[str, str] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether the busiest GPU's peak fits in the GPU's memory (True where the memory is not known)."""
        return not self.memory_limit_bytes or self.memory_per_gpu_bytes <= self.memory_limit_bytes

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in self.breakdown.items() if v > 0)
        line = (
            f"step {self.step_time_s:.3f} s on {self.hardware} + {self.network}: "
            f"{self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {100 * self.mfu:.1f}%, "
            f"{self.memory_per_gpu_bytes / 2**30:.1f} GiB per GPU ({parts})"
        )
        notes = [self.fit_note] if self.fit_note else []
        if "not fitted on" in self.efficiency_source:  # a fit on one part used on another: said
            notes.append(f"efficiency {self.efficiency:.3f}, {self.efficiency_source}")
        return "\n".join([line, *notes])


def fit_note(kinds: list[RankKind], limit_bytes: float, hardware: str) -> str:
    """One line when the busiest rank kind's peak is over ``limit_bytes``: by how much, what holds the
    room (states or activations) and the plan options that shrink that part; "" when it fits."""
    kind = max(kinds, key=lambda k: float(k.memory.get("peak", 0)))
    peak = float(kind.memory.get("peak", 0))
    if not limit_bytes or peak <= limit_bytes:
        return ""
    states = sum(float(kind.memory.get(k, 0)) for k in ("parameters", "gradients", "optimizer"))
    activations = float(kind.memory.get("activations", 0))
    if activations >= states:
        larger, options = "activations", "checkpointing='full', a smaller micro_batch_size, or more tp or pp"
    else:
        larger, options = "parameters, gradients and optimizer states", "more GPUs to shard over, or more tp or pp"
    who = "" if len(kinds) == 1 else f" ({kind.name})"
    return (
        f"does not fit: {peak / 2**30:.1f} GiB per GPU{who} against the {hardware}'s "
        f"{limit_bytes / 2**30:.1f} GiB ({limit_bytes / 1e9:.0f} GB), {100 * (peak / limit_bytes - 1):.1f}% over; "
        f"the larger part is "
        f"{larger} ({max(states, activations) / 2**30:.1f} GiB): try {options}"
    )


def dimension_sizes(plan: Plan) -> dict[str, int]:
    """Each mesh dimension's size for ``plan`` (``MESH_ORDER``)."""
    dp = plan.gpus // (plan.tp * plan.pp * plan.cp)
    if plan.dp == "fsdp":
        replicate, shard = 1, dp
    elif plan.dp in ("ddp", "zero1"):
        replicate, shard = dp, 1
    else:  # hsdp: shard inside groups of plan.shard, replicate across them
        shard = plan.shard or 1  # Plan.check requires it for hsdp
        replicate = dp // shard
    return {"pp": plan.pp, "dp_replicate": replicate, "dp_shard": shard, "cp": plan.cp, "tp": plan.tp}


def _groups(plan: Plan) -> dict[str, tuple[int, int]]:
    """Each dimension's (group size, stride): a group's ranks are ``stride`` apart (``MESH_ORDER``, tp
    innermost and consecutive ranks on a node)."""
    sizes = dimension_sizes(plan)
    groups = {dim: (sizes[dim], math.prod(sizes[inner] for inner in MESH_ORDER[i + 1:]))
              for i, dim in enumerate(MESH_ORDER)}
    if plan.cp > 1:  # FSDP over dp_shard and cp at once (torchtitan's "dp_shard_cp"; rank/dryrun.py)
        groups["dp_shard_cp"] = (sizes["dp_shard"] * plan.cp, plan.tp)
        if plan.dp == "zero1":  # its optimizer reduces over every replica and cp rank ("dp_cp")
            groups["dp_cp"] = (sizes["dp_replicate"] * plan.cp, plan.tp)
    return groups


def links(plan: Plan, hardware: Hardware) -> dict[str, str]:
    """Which link each dimension's groups cross: "node" when a group's ranks share a node, else
    "network" ("none" for a dimension of size 1: no group, nothing crosses)."""
    return {dim: "none" if size == 1 else "node" if stride * size <= hardware.gpus_per_node else "network"
            for dim, (size, stride) in _groups(plan).items()}


def ranks_per_node(plan: Plan, hardware: Hardware) -> dict[str, int]:
    """How many of a dimension's group's ranks share a node, for each dimension: all of them where the
    group fits in a node; one where its ranks are a node or more apart (FSDP's group under TP 8)."""
    return {dim: math.gcd(size, max(1, hardware.gpus_per_node // stride))
            for dim, (size, stride) in _groups(plan).items()}


def _collective_s(
    c: CollectiveCount, link: str, hardware: Hardware, network: Network, per_node: int = 1,
    chosen: dict[str, set[str]] | None = None,
) -> float:
    if c.op == "permute" and c.group_size > 1:  # a ring's step: each rank sends its bytes to one neighbour
        return _point_to_point_s(c, link, hardware, network)
    if c.op not in _COLLECTIVE_OPS or c.group_size < 2:
        return 0.0
    # The dry run counts what each rank puts in: an all-gather's shard, a reduce-scatter's whole
    # input; theory's sizes are the whole tensor the collective makes or reduces.
    size = c.bytes * c.group_size if c.op == "all_gather" else c.bytes
    if hardware.nccl and c.op in ("all_reduce", "all_gather", "reduce_scatter"):
        ppn = math.gcd(c.group_size, per_node if link != "node" else c.group_size)
        fastest = algorithm_times(
            c.op, size, c.group_size, ppn, hardware.node_link_bytes_per_s, hardware.node_link_latency_s,
            network.bytes_per_s, network.latency_s, nvls=hardware.nvls,
        )[0]
        if chosen is not None:
            chosen.setdefault(f"{c.dim} {c.op}", set()).add(fastest.algorithm)
        return fastest.seconds
    bandwidth, latency = (
        hardware.node_link_by_op.get(c.op, (hardware.node_link_bytes_per_s, hardware.node_link_latency_s))
        if link == "node"
        else network.by_op.get(c.op, (network.bytes_per_s, network.latency_s))
    )
    return collective_time_s(c.op, size, c.group_size, bandwidth, latency)


def _point_to_point_s(c: CollectiveCount, link: str, hardware: Hardware, network: Network) -> float:
    bandwidth, latency = (
        (hardware.node_link_bytes_per_s, hardware.node_link_latency_s)
        if link == "node"
        else (network.bytes_per_s, network.latency_s)
    )
    return latency + float(c.bytes) / bandwidth


def _kind_time(
    kind: RankKind, plan: Plan, micro_batches: int, hw: Hardware, net: Network, dims: dict[str, str], efficiency: float,
    per_node: dict[str, int], chosen: dict[str, set[str]] | None = None,
) -> tuple[float, dict[str, float]]:
    """One rank kind's micro-batch time (the pipeline's unit) and its per-step extras."""
    compute_mb = compute_s(kind, plan, hw, efficiency)
    host_mb = kind.dtensor_ops_per_micro_batch * hw.host_s_per_dtensor_op
    per_mb: dict[str, float] = {}
    per_step: dict[str, float] = {}
    # Under a pipeline, FSDP's collectives run once a step (torch's schedules keep the parameters
    # gathered and reduce the gradients after a stage's last micro-batch): the all-gathers hide behind
    # the first micro-batch as FSDP's always do, the gradients' reduction waits for nothing after it.
    once: dict[str, dict[str, float]] = {}
    calls_once: dict[str, int] = {}
    for c in kind.collectives:
        link = dims.get(c.dim, "network")
        if c.op in ("send", "recv"):
            # Each boundary's transfer, counted once (the send; its recv is the other stage's).
            if c.op == "send":
                per_mb["pp"] = per_mb.get("pp", 0.0) + c.calls_per_micro_batch * _point_to_point_s(c, link, hw, net)
            continue
        seconds = _collective_s(c, link, hw, net, per_node.get(c.dim, 1), chosen)
        if c.phase == "optimizer":
            per_step[c.dim] = per_step.get(c.dim, 0.0) + c.calls_per_micro_batch * seconds
        elif plan.pp > 1 and c.dim in _ONCE_UNDER_PIPELINE:
            phases = once.setdefault(c.dim, {})
            phases[c.phase] = phases.get(c.phase, 0.0) + c.calls_per_micro_batch * seconds
            if c.phase == "forward":
                calls_once[c.dim] = calls_once.get(c.dim, 0) + c.calls_per_micro_batch
        else:
            per_mb[c.dim] = per_mb.get(c.dim, 0.0) + c.calls_per_micro_batch * seconds
    for dim, phases in once.items():
        gathers = _exposed_beside(phases.get("forward", 0.0), calls_once.get(dim, 0), compute_mb, hw.overlap)
        per_step[dim] = per_step.get(dim, 0.0) + gathers + phases.get("backward", 0.0)
    exposed_mb = {}
    for dim, seconds in per_mb.items():
        if dim in _OVERLAPPED:
            calls = sum(c.calls_per_micro_batch for c in kind.collectives if c.dim == dim)
            exposed_mb[dim] = _exposed_beside(seconds, calls, compute_mb, hw.overlap)
        else:
            exposed_mb[dim] = seconds
    micro_batch_s = compute_mb + host_mb + sum(exposed_mb.values())
    extras = {"compute": compute_mb * micro_batches}
    if host_mb:
        extras["DTensor's host time"] = host_mb * micro_batches
    extras.update({f"exposed {dim}": s * micro_batches for dim, s in exposed_mb.items()})
    extras.update({f"exposed {dim} (once a step)": s for dim, s in per_step.items()})
    return micro_batch_s, extras


def _exposed_beside(seconds: float, calls: int, compute_s: float, overlap: float) -> float:
    """What shows of ``calls`` collectives taking ``seconds`` that run beside ``compute_s`` of compute:
    what the compute covers is hidden (all of it, up to the compute, where the hardware overlaps fully),
    but for the first call, which waits for nothing to start."""
    return max(0.0, seconds - overlap * compute_s) + overlap * seconds / (calls or 1)


def _optimizer_s(kind: RankKind, hw: Hardware) -> float:
    memory = kind.memory
    # The optimizer reads the gradients sharded, as many bytes as the parameters (fp32 both): under a
    # pipeline ``memory["gradients"]`` is the unsharded accumulation, reduced before the step.
    touched = 2 * memory.get("parameters", 0) + memory.get("optimizer", 0)
    return 2 * float(touched) / hw.memory_bytes_per_s  # each read once and written once


def predict_report(
    report: DryRunReport,
    hardware: str | Hardware = "h100-sxm",
    network: str | Network = "ib-400g",
    efficiency: float | None = None,
) -> Prediction:
    """The prediction for a dry run's report (``scale.dry_run(plan)``) on ``hardware`` and ``network``."""
    hw, net = hardware_named(hardware), network_named(network)
    eff = float(efficiency) if efficiency is not None else hw.efficiency if hw.efficiency is not None else EFFICIENCY
    source = ("passed to predict" if efficiency is not None else hw.efficiency_source or "measured on this lab"
              if hw.efficiency is not None else f"{SXM_FIT[1]}; not fitted on {hw.name}")
    if not 0 < eff <= 1:
        raise ValueError(f"efficiency must be in (0, 1], the share of its kernels' time (a lab's: of its peak) a "
                         f"step reaches; got {efficiency!r}")
    plan = report.plan
    dims = links(plan, hw)
    m = report.micro_batches
    chosen: dict[str, set[str]] = {}
    per_node = ranks_per_node(plan, hw)
    timed = [(_kind_time(k, plan, m, hw, net, dims, eff, per_node, chosen), k) for k in report.kinds]
    (slowest_mb, extras), slowest = max(timed, key=lambda t: t[0][0])
    chunks = getattr(plan, "chunks", 1)
    split = getattr(plan, "layers_per_stage", ())
    if plan.pp > 1 and len(set(split)) > 1:
        # Uneven stages: the slowest sets the pace of the m micro-batches; the others' fill and drain
        # the pipeline once (each pipeline rank's micro-batch time over its v chunks), which for
        # equal stages is the uniform formula below: m*t + (p-1)*t/v.
        per = plan.gpus // plan.pp
        every = sum(t[0] * (k.ranks // per) for t, k in timed)
        busy = m * slowest_mb + (every - slowest_mb) / chunks
    elif plan.pp > 1:
        # Forward and backward shares do not change the step: the theory adds them (f + b).
        busy = pipeline_step_time_s(plan.pp, m, slowest_mb / 3, 2 * slowest_mb / 3, plan.schedule, chunks)
    else:
        busy = slowest_mb * m
    optimizer = max(_optimizer_s(k, hw) for k in report.kinds)
    after = sum(v for key, v in extras.items() if key.endswith("(once a step)"))
    step = busy + optimizer + after
    breakdown = dict(extras)
    breakdown["bubble"] = busy - slowest_mb * m
    breakdown["optimizer step"] = optimizer
    peak = hw.peak_flops.get(plan.precision) or hw.peak_flops["bf16"]
    # Model FLOPs per GPU: the ranks' kinds weighted by how many ranks each is.
    ranks = sum(k.ranks for k in report.kinds)
    model_flops = sum(k.flops_per_micro_batch * k.ranks for k in report.kinds) * m / ranks
    memory = max(float(k.memory.get("peak", 0)) for k in report.kinds)
    return Prediction(
        step_time_s=step,
        tokens_per_s_per_gpu=report.tokens_per_step / step / plan.gpus,
        mfu=model_flops / step / peak,
        memory_per_gpu_bytes=memory,
        breakdown=breakdown,
        links=dims,
        hardware=hw.name,
        network=net.name,
        efficiency=eff,
        efficiency_source=source,
        compute_by_kernel=({k: v * m / eff for k, v in kernel_s(slowest, plan, hw).items()}
                           if hw.kernel_rates is not None else {}),
        memory_limit_bytes=hw.memory_bytes,
        fit_note=fit_note(list(report.kinds), hw.memory_bytes, hw.name),
        algorithms={key: "/".join(sorted(names)) for key, names in sorted(chosen.items())},
    )


def predict(
    plan: Plan,
    hardware: str | Hardware = "h100-sxm",
    network: str | Network = "ib-400g",
    report: DryRunReport | None = None,
    efficiency: float | None = None,
) -> Prediction:
    """``plan``'s step time, tokens/s per GPU, MFU and memory per GPU on ``hardware`` and ``network``
    (see the module for the model). ``report``: the plan's dry run, made now if not given."""
    if report is None:
        import importlib

        run = getattr(importlib.import_module("distlab.scale"), "dry_run", None)
        if run is None:
            raise ValueError("this build has no scale.dry_run yet: pass report=, a dry run's report of the plan")
        report = run(plan)
    elif report.plan != plan:
        raise ValueError("report is the dry run of another plan: pass scale.dry_run(plan) for this plan")
    return predict_report(report, hardware, network, efficiency)
