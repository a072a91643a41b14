"""A plan's real torch code, run for one rank of each kind at the plan's full world size, in one process.

    python -m distlab.rank.dryrun < plan.json > report.json     (what ``distlab.scale.dry_run`` runs)

Each rank kind joins torch's fake process-group backend as one rank of ``plan.gpus`` (collectives return
at once and move nothing), builds its part of the model on the meta device, parallelises it with the
real APIs (``parallelize_module`` for tp, ``fully_shard`` over the dp mesh dimension, or the 2-D
(dp_replicate, dp_shard) mesh for HSDP; DDP is HSDP with shard groups of one: FSDP2's replicate-only
mode, one all-reduce per unit), then, under FakeTensorMode (shapes without data: no weight takes real
memory), materialises it and runs one micro-batch's forward and backward and the optimizer's step.
The mesh itself is made outside FakeTensorMode: its own tensors must be real.

What is measured on that step, by dispatch modes around it: every tensor alive (torch's MemTracker:
the peak), every collective (op, the bytes this rank puts in, its group and so its mesh dimension, the
phase), the FLOPs (torch's formulas, ``torch.utils.flop_counter``, on this rank's local ops). What is
read: the local parameter shards, gradients and the optimizer's states. What is derived, and why:

- Pipeline parallelism: torch.distributed.pipelining's schedules need every stage of the pipeline
  in their own processes (they send to and receive from their neighbours), so a stage is run alone:
  its module's forward and backward for one micro-batch. What its forward saved for backward is
  then held for each other micro-batch in flight (``theory.in_flight_micro_batches`` of the
  schedule), beside the one micro-batch's whole peak (with activation checkpointing the saved
  tensors are only the blocks' inputs, the peak a block run again); its send/recv per
  micro-batch are the stage boundary's activation (the shape of its output, its gradient backward).
  FSDP's gradients are held unsharded in fp32 across the micro-batches, as torch's schedules keep
  them (reduced once, after the stage's last backward); its all-gathers and reduce-scatters, counted
  on the one micro-batch run, are then once a step's (``scale.predict`` charges them so).
- Context parallelism (``cp > 1``): torch's own (``context_parallel``: the micro-batch's tokens,
  targets and positions load-balanced over the cp ranks, SDPA replaced by ring attention), on CPU
  through ``torchcompat_cp``; the ring's keys and values pass by "permute" (a send to the next rank)
  or one all-gather (``Plan.cp_rotate``). FSDP shards over dp_shard and cp at once ("dp_shard_cp").
  torch's formula counts each of the ring's attention calls whole; they are scaled to the square's
  share (``dryrun_counts.ring_attention_scale``), so FLOPs and MFU compare with and without cp.
- Recomputation's FLOPs: what a checkpointed block runs again in backward is counted as it runs
  (torch's checkpoint runs it under a context the model gives it: ``nn.llama.recomputing``), and
  flash attention's backward recomputes its scores (``LocalFlops.recomputed``). Both are reported
  apart from the model's FLOPs, which leave them out as PaLM's MFU does; the predicted compute time
  counts both.
- A deep stage (``dryrun_depth.DEEP`` blocks or more, one stage module per rank) is run at two
  shallow depths and each figure read at its depth on the line through the two (``dryrun_depth``
  says why that is exact and what it checks): Llama 3 70B's dry run at 1,024 GPUs took 69 s, 30 s so
  (benchmarks/bench_dry_run_time.py).
- The optimizer's states are created by one step before the measured one, as in every step but the
  first: the measured step's peak is that of training, not of start-up.
- The optimizer steps the parameters' local shards (``ShardStepAdamW``): AdamW is element-wise, so a
  DTensor runs it as these same ops on each shard, with no collective; stepping the shards gives the
  same tensors and bytes without DTensor working out a placement for each of the hundreds of
  tensors in each of its foreach ops, which took 19 of a 46 s dry run of Llama 3 8B at tp 8.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from ..nn.llama import TransformerStage, stage_modules, tensor_parallel_plan
from ..scale.models import ModelConfig
from ..theory import in_flight_micro_batches
from . import float8, torchcompat_cp, torchcompat_fake
from .dryrun_counts import Collectives, LocalFlops, ring_attention_scale
from .dryrun_depth import DEEP, SHALLOW, Measured, Segments, extrapolate
from .dryrun_kinds import forked, kinds
from .dryrun_plan import MESH, half, mesh_dims, micro_batches, sequence_split
from .shard_adamw import ShardStepAdamW
from .zero1 import DistributedAdamW

if TYPE_CHECKING:
    from ..scale.plan import PlanJSON
    from ..scale.report import CollectiveJSON, DryRunJSON, MemoryJSON, RankKindJSON

#: What one micro-batch's backward starts from, per stage module: the loss (and None), or the stage's
#: output and the gradient that would come back for it.
Backward = list[tuple[torch.Tensor, "torch.Tensor | None"]]
#: Shards a micro-batch's sequence tensors in place along their given dimensions (context parallelism).
Shard = Callable[[list[torch.Tensor], list[int]], None]

__all__ = ["ShardStepAdamW", "backward", "dry_run", "main", "micro_batch", "parallelize", "tracked_step"]


def parallelize(plan: PlanJSON, cfg: ModelConfig, mesh: DeviceMesh, stage: int) -> list[TransformerStage]:
    with torch.device("meta"):  # no memory: the weights are made (as fake tensors) under FakeTensorMode
        modules = stage_modules(cfg, plan["pp"], plan["chunks"], stage, plan["stage_layers"])
    dp_mesh = data_parallel_mesh(plan, mesh)
    bf16 = half(plan)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    # torchtitan keeps parameters gathered between forward and backward under pp (no reshard after
    # forward): each micro-batch would otherwise gather them twice.
    reshard = plan["pp"] == 1
    for module in modules:
        module.checkpointing = plan["checkpointing"]
        float8.convert(plan, module)  # fp8's linears first, as torchtitan converts before it parallelises
        if plan["tp"] > 1:
            tp_plan = tensor_parallel_plan(module, sequence_parallel=plan["sequence_parallel"],
                                           styles=float8.tp_styles(plan))
            parallelize_module(module, mesh["tp"], tp_plan)
        if plan["dp"] == "zero1":  # replicated, in the compute dtype: the optimizer shards (rank.zero1)
            module.to(torch.bfloat16 if bf16 else torch.float32)
            continue
        mp_policy = policy if policy is not None else MixedPrecisionPolicy()  # fully_shard's default
        for block in module.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    return modules


def data_parallel_mesh(plan: PlanJSON, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: dp_shard (or HSDP's (dp_replicate, dp_shard)); under context
    parallelism the cp ranks join the shard dimension ("dp_shard_cp", torchtitan's): they hold the
    same weights, so FSDP shards them over both and reduces their gradients together."""
    shard = "dp_shard"
    if plan["cp"] > 1:
        torchcompat_cp.flatten(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        shard = "dp_shard_cp"
    return mesh[shard] if plan["dp"] == "fsdp" else mesh["dp_replicate", shard]


def _local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def micro_batch(
    plan: PlanJSON, cfg: ModelConfig, modules: list[TransformerStage], tp: bool, shard: Shard | None = None
) -> Backward:
    """One micro-batch's forward through this rank's stage modules: what each backward starts from
    (the loss, or the stage's output and the gradient that would come back for it). Under context
    parallelism ``shard`` takes the sequence's tensors (token ids, targets, positions) and leaves this
    rank's share of each in place, for the rest of the step (``tracked_step``)."""
    batch, seq = plan["micro_batch_size"], plan["seq_len"]
    dtype = torch.bfloat16 if half(plan) else torch.float32
    tokens = targets = positions = None
    if plan["cp"] > 1:
        assert shard is not None, "context parallelism needs the step's shard (tracked_step gives it)"
        tokens, targets, positions = (torch.randint(0, cfg.vocab, (batch, seq)),
                                      torch.randint(0, cfg.vocab, (batch, seq)), torch.arange(seq))
        shard([tokens, targets, positions], [1, 1, 0])
    losses: Backward = []
    for module in modules:
        if module.tok_embeddings is not None:
            x = tokens if tokens is not None else torch.randint(0, cfg.vocab, (batch, seq))
        else:  # the previous stage's activation, as it arrives: a leaf whose gradient is sent back
            x = torch.empty(batch, seq // sequence_split(plan), cfg.dim, dtype=dtype, requires_grad=True)
        out = module(x, positions)
        if module.output is not None:
            if targets is None:
                targets = torch.randint(0, cfg.vocab, (batch, seq))
            with loss_parallel() if tp and isinstance(out, DTensor) else nullcontext():
                loss = F.cross_entropy(out.flatten(0, 1).float(), targets.flatten(0, 1))
                losses.append((loss, None))
        else:
            losses.append((out, torch.ones_like(out)))
    return losses


def backward(losses: Backward, tp: bool) -> None:
    for out, grad in reversed(losses):
        with loss_parallel() if tp and isinstance(out, DTensor) else nullcontext():
            out.backward(grad)


def _measure(plan: PlanJSON, cfg: ModelConfig, rank: int, stage: int | None) -> tuple[Measured, list[CollectiveJSON]]:
    """One rank's step, measured (and its stage boundary's sends and receives)."""
    dims = {"pp": plan["pp"], **mesh_dims(plan)}
    dist.init_process_group("fake", store=torchcompat_fake.fake_store(), rank=rank, world_size=plan["gpus"])
    try:
        mesh = init_device_mesh("cpu", tuple(dims[d] for d in MESH), mesh_dim_names=MESH)
        modules = parallelize(plan, cfg, mesh, stage or 0)
        replicas = mesh.get_group("dp_replicate")  # what zero1's optimizer reduces over
        joined: tuple[str, ...] = ()
        if plan["cp"] > 1:  # the cp ranks hold the same weights: their gradients are reduced together
            joined = ("dp_shard_cp",)
        if plan["cp"] > 1 and plan["dp"] == "zero1":
            joined = ("dp_cp",)
            replicas = torchcompat_cp.flatten(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp").get_group()
        dims_of = {str(mesh.get_group(d).group_name): d for d in (*MESH, *joined)}
        params = [p for m in modules for p in m.parameters()]
        segments = Segments(block for m in modules for block in m.layers.values())
        with torchcompat_fake.sharding_propagation_unseen(), torchcompat_fake.fake_tensor_mode():
            for m in modules:
                m.to_empty(device="cpu")
            optimizer: ShardStepAdamW | DistributedAdamW = (
                DistributedAdamW(params, replicas, lr=1e-4, foreach=True)
                if plan["dp"] == "zero1" else ShardStepAdamW(params, lr=1e-4, foreach=True))
            for p in params:  # one step before the measured one makes the optimizer's states (see the module)
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            counter, flops = Collectives(dims_of), LocalFlops(ring_attention_scale(plan["cp"]))
            memory = tracked_step(plan, cfg, modules, optimizer, counter, flops, segments=segments,
                                  cp_mesh=mesh["cp"] if plan["cp"] > 1 else None)
        measured: Measured = {"memory": memory, "collectives": counter.report(), "flops": flops.flops,
                              "recomputed": flops.recomputed, "fp8": flops.fp8, "attention": flops.attention,
                              "streamed": flops.streamed, "fused": flops.chains.bytes,
                              "dtensor_ops": counter.dtensor_ops, "segments": segments.peaks}
        return measured, _point_to_point(plan, cfg, modules)
    finally:
        dist.destroy_process_group()


def _run_kind(plan: PlanJSON, cfg: ModelConfig, name: str, ranks: int, rank: int, stage: int | None) -> RankKindJSON:
    """One rank kind's report: its step measured (a deep stage from two shallow ones: ``dryrun_depth``),
    then what a pipeline's other micro-batches add."""
    dims = {"pp": plan["pp"], **mesh_dims(plan)}
    depth = plan["stage_layers"][stage or 0]
    measured: Measured | None = None
    if plan["chunks"] == 1 and depth >= DEEP:
        (shallow, _), (deeper, boundary) = forked(_measure_shallow, plan, cfg, rank, stage or 0, name=name)
        measured = extrapolate(shallow, deeper, depth)
    if measured is None:
        measured, boundary = forked(_measure, plan, cfg, rank, stage, name=name)
    memory = measured["memory"].copy()
    activations, peak = memory["activations"], memory["peak"]
    collectives = measured["collectives"]
    if plan["pp"] > 1 and stage is not None:
        count = micro_batches(plan)
        in_flight = in_flight_micro_batches(stage, plan["pp"], count, plan["schedule"], plan["chunks"])
        # The other micro-batches in flight hold what their forward saved for backward; the
        # backward's own working memory (a checkpointed block run again, its gradients) is
        # one micro-batch's, once. Without checkpointing the two differ little.
        saved = memory.get("saved", activations)
        shard = dims["dp_shard"]
        if shard > 1:
            # Under pp FSDP keeps each unit's parameters gathered from forward to backward
            # (``parallelize``): alive after forward, but once, not per micro-batch.
            gathered = memory["parameters"] * shard * (2 if half(plan) else 4) // 4
            saved = max(0, saved - gathered)
            # torch's schedules turn FSDP's gradient reduction off until a stage's last micro-batch
            # (pipelining/stage.py: set_requires_gradient_sync(False), then perform_reduce_grad):
            # the stage keeps its gradients unsharded, in fp32 (FSDP2 accumulates in the reduce
            # dtype), from its first backward to the step's end, where the step measured here
            # held them sharded.
            accumulated = memory["parameters"] * shard
            peak += accumulated - memory["gradients"]
            memory["gradients"] = accumulated
        peak += round((in_flight - 1) * saved)
        activations = round(activations + (in_flight - 1) * saved)
        collectives = collectives + boundary
    return {
        "name": name, "ranks": ranks, "rank": rank, "stage": stage,
        "memory": {**memory, "activations": int(activations), "peak": int(peak)},
        "collectives": collectives,
        # PaLM's model FLOPs; what is computed again (checkpointing, flash attention's scores) apart
        "flops_per_micro_batch": float(measured["flops"] - measured["recomputed"]),
        "fp8_flops_per_micro_batch": float(measured["fp8"]),
        "attention_flops_per_micro_batch": float(measured["attention"]),
        "streamed_bytes_per_micro_batch": float(measured["streamed"]),
        "fused_bytes_per_micro_batch": float(measured["fused"]),
        "dtensor_ops_per_micro_batch": float(measured["dtensor_ops"]),
        "recompute_flops_per_micro_batch": float(measured["recomputed"]),
    }


def _measure_shallow(
    plan: PlanJSON, cfg: ModelConfig, rank: int, stage: int
) -> list[tuple[Measured, list[CollectiveJSON]]]:
    """The rank's step with SHALLOW and SHALLOW + 1 blocks in its stage, one after the other in one
    process: the same rank of the same world, so what torch caches on the first (DTensor's sharding
    decisions, FakeTensor's op cache) holds for the second, which takes half the time."""
    return [_measure(_with_depth(plan, stage, n), cfg, rank, stage) for n in (SHALLOW, SHALLOW + 1)]


def _with_depth(plan: PlanJSON, stage: int, layers: int) -> PlanJSON:
    """``plan`` with ``layers`` blocks in ``stage`` (what the shallow runs of ``dryrun_depth`` run)."""
    splits = list(plan["stage_layers"])
    splits[stage] = layers
    return {**plan, "stage_layers": splits}


def tracked_step(
    plan: PlanJSON, cfg: ModelConfig, modules: list[TransformerStage], optimizer: torch.optim.Optimizer,
    counter: Collectives | None = None, *modes: AbstractContextManager[object], segments: Segments | None = None,
    cp_mesh: DeviceMesh | None = None,
) -> MemoryJSON:
    """One micro-batch's forward and backward, then the optimizer's step, under torch's MemTracker (and
    ``counter`` and ``modes``, dispatch modes around the same step): what this rank holds, in bytes, by
    category. Activations are the peak up to the end of backward less the parameters and the optimizer's
    states, which live through the step; the peak is the whole step's, the optimizer's included. The
    dry run runs it under FakeTensor, ``scale.measure`` on a lab's real tensors (``rank.planrun``).
    ``segments`` (``dryrun_depth``) keeps the peak of each block's part of the step."""
    params = [p for m in modules for p in m.parameters()]
    tp = plan["tp"] > 1
    tracker = torchcompat_fake.memory_tracker(*modules, optimizer, observe=segments.observe if segments else None)
    with tracker, contextlib.ExitStack() as stack:
        # The counter entered last, innermost: it sees each op first, as it did before this was shared
        # (under the FLOP mode first, DTensor's loss_parallel reductions would be counted too).
        for mode in (*modes, counter):
            if mode is not None:
                stack.enter_context(mode)
        def shard(buffers: list[torch.Tensor], dims: list[int]) -> None:  # context parallelism, to the step's end
            assert cp_mesh is not None, "cp > 1 needs the cp mesh"
            stack.enter_context(torchcompat_cp.context_parallel(cp_mesh, buffers, dims, plan["cp_rotate"]))

        losses = micro_batch(plan, cfg, modules, tp, shard)
        after_forward = torchcompat_fake.tracked_current_bytes(tracker)
        _phase("backward", counter, segments, modes)
        backward(losses, tp)
        forward_backward_peak = torchcompat_fake.tracked_peak_bytes(tracker)
        gradients = _local_bytes(p.grad for p in params)
        _phase("optimizer", counter, segments, modes)
        optimizer.step()
        float8.after_step(plan, modules)
    peak = torchcompat_fake.tracked_peak_bytes(tracker)
    parameters = _local_bytes(params)
    states = (optimizer.state_tensors() if isinstance(optimizer, DistributedAdamW)
              else [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
    optimizer_bytes = _local_bytes(states)
    return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer_bytes,
            "activations": forward_backward_peak - parameters - optimizer_bytes, "peak": peak,
            "saved": after_forward - parameters - optimizer_bytes}


def _phase(name: str, counter: Collectives | None, segments: Segments | None,
           modes: tuple[AbstractContextManager[object], ...] = ()) -> None:
    for mode in (counter, *modes):
        if isinstance(mode, LocalFlops):
            mode.chains.close()
        if isinstance(mode, (Collectives, LocalFlops)):
            mode.phase = name
    if segments is not None:
        segments.phase(name)


def _point_to_point(plan: PlanJSON, cfg: ModelConfig, modules: list[TransformerStage]) -> list[CollectiveJSON]:
    """Each stage boundary's send and receive per micro-batch: a block's output, (micro_batch_size,
    seq_len, dim) in the compute dtype, forward, and its gradient backward. Every stage module but the
    model's last sends one forward; every one but the first receives one."""
    size = plan["micro_batch_size"] * plan["seq_len"] // sequence_split(plan) * cfg.dim * (
        2 if half(plan) else 4)
    sends = sum(1 for m in modules if m.output is None)
    recvs = sum(1 for m in modules if m.tok_embeddings is None)

    def one(op: str, calls: int, phase: str) -> CollectiveJSON:
        return {"op": op, "dim": "pp", "group_size": 2, "bytes": size, "calls_per_micro_batch": calls, "phase": phase}

    found = [one("send", sends, "forward"), one("recv", sends, "backward")] if sends else []
    return found + ([one("recv", recvs, "forward"), one("send", recvs, "backward")] if recvs else [])


def dry_run(plan: PlanJSON) -> DryRunJSON:
    """The report (``distlab.scale.report.DryRunReport``'s JSON) of ``plan`` (``Plan.to_json()``)."""
    start = time.perf_counter()
    cfg = ModelConfig(**plan["model"])
    runs = [_run_kind(plan, cfg, *kind) for kind in kinds(plan)]
    m = micro_batches(plan)
    return {"plan": plan, "parameters": _count(cfg), "kinds": runs, "seconds": time.perf_counter() - start,
            "micro_batches": m, "tokens_per_step": m * plan["micro_batch_size"] * plan["seq_len"]
            * plan["gpus"] // (plan["tp"] * plan["pp"] * plan["cp"])}


def _count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = stage_modules(cfg, 1, 1, 0)[0]
    return sum(p.numel() for p in model.parameters())  # shared (tied) weights are counted once


def main() -> None:
    try:
        report = dry_run(json.load(sys.stdin))
    except Exception as exc:  # noqa: BLE001 - the launcher shows this one line
        print(f"dry run failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        sys.exit(1)
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
