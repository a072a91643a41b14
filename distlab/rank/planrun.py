"""A ``scale.Plan`` run for real on a lab's ranks, and what ``scale.calibrate`` measures of the lab.

The dry run (``rank/dryrun.py``) runs a plan's code at its full world size under a fake process group
and FakeTensor. Here the same code (``parallelize``, ``micro_batch``, ``backward``, ``tracked_step``)
runs on the lab's own process group, with real weights on each rank, at the lab's world size: what
``scale.measure`` times and weighs, against what ``scale.predict`` said of the same plan.

Called by the notebook through ``lab.run`` with a plan's JSON (``Plan.to_json()``); every rank of the
lab runs the same call, as every rank of a job would.

- ``run_plan``: warm-up steps, then timed steps (each between two barriers: the step of the slowest
  rank, as a job's step is), one micro-batch with its DTensor ops counted, then one step under torch's
  MemTracker, exactly as the dry run tracks its step.
- ``compute_rate``: this rank's matmul rate (the lab's peak), and the FLOP rate it reaches on the
  plan's model, whole and alone on each rank (no collective), all ranks at once, since they share the
  machine's cores as they will in the plan: the fraction of the peak reached is the lab's efficiency.
- ``collective_times``: all-reduces, all-gathers and reduce-scatters of several sizes on the lab's
  group, timed, for the fit of the link (latency and bandwidth in the ring model, op by op).
- ``copy_rate``: the bytes per second a rank copies, all ranks at once: the optimizer step's memory
  bandwidth.
- ``dtensor_host_s``: the host's seconds for each op DTensor dispatches, beyond its local ops, on a
  model too small for its kernels to matter: what tensor parallelism adds on CPU ranks, which run
  their Python and their kernels in turn.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, TypedDict, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..nn.llama import TransformerStage, stage_modules
from ..scale.models import ModelConfig
from .dryrun import backward, micro_batch, parallelize, tracked_step
from .dryrun_counts import LocalFlops
from .dryrun_plan import MESH, mesh_dims, micro_batches
from .torchcompat_dispatch import DispatchMode, Op, wrapper_subclass_in
from .zero1 import DistributedAdamW

if TYPE_CHECKING:
    from ..scale.plan import PlanJSON
    from ..scale.report import MemoryJSON

__all__ = ["PlanRun", "collective_times", "compute_rate", "copy_rate", "dtensor_host_s", "run_plan"]


class PlanRun(TypedDict):
    """What :func:`run_plan` returns to ``scale.measure``."""

    step_s: list[float]
    memory: MemoryJSON
    micro_batches: int
    dtensor_ops_per_micro_batch: int
    reference_s: list[float]  # the reference's micro-batch before and after each timed step (run_plan's reference)


def _initialised(modules: list[TransformerStage]) -> None:
    """Real weights for modules built on the meta device: small normal values, norms at one. (Memory
    left as it came could hold NaNs and denormals, which slow a CPU's matmuls by orders of magnitude.)"""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in modules:
            module.to_empty(device="cpu")
            for name, p in module.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)


def _step(
    plan: PlanJSON, cfg: ModelConfig, modules: list[TransformerStage], optimizer: torch.optim.Optimizer, count: int
) -> None:
    tp = plan["tp"] > 1
    for _ in range(count):
        backward(micro_batch(plan, cfg, modules, tp), tp)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _parallelized(plan: PlanJSON) -> tuple[ModelConfig, DeviceMesh, list[TransformerStage]]:
    """``plan``'s model, its mesh on the lab's process group, and this rank's modules of it, parallelised
    as the dry run does and given real weights."""
    cfg = ModelConfig(**plan["model"])
    dims = {"pp": plan["pp"], **mesh_dims(plan)}
    mesh = init_device_mesh("cpu", tuple(dims[d] for d in MESH), mesh_dim_names=MESH)
    modules = parallelize(plan, cfg, mesh, 0)
    _initialised(modules)
    return cfg, mesh, modules


def _whole_model(plan: PlanJSON) -> tuple[ModelConfig, list[TransformerStage]]:
    """``plan``'s model whole on this rank (one stage, no parallelism), with real weights."""
    cfg = ModelConfig(**plan["model"])
    with torch.device("meta"):
        modules = stage_modules(cfg, 1, 1, 0)
    for module in modules:
        module.checkpointing = plan["checkpointing"]
    _initialised(modules)
    return cfg, modules


def _micro_batch_step(plan: PlanJSON, cfg: ModelConfig, modules: list[TransformerStage]) -> Callable[[], None]:
    """One micro-batch's forward and backward of ``modules``, their gradients dropped after it."""
    tp = plan["tp"] > 1

    def step() -> None:
        backward(micro_batch(plan, cfg, modules, tp), tp)
        for module in modules:
            module.zero_grad(set_to_none=True)

    return step


def _slowest_s(seconds: float, group: dist.ProcessGroup | None = None) -> float:
    """The slowest rank's ``seconds`` (of ``group``), on every rank: a step ends when its slowest rank's does."""
    took = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return float(took.item())


def run_plan(plan: PlanJSON, steps: int = 5, warmup: int = 2, reference: PlanJSON | None = None) -> PlanRun:
    """``plan`` trained for ``warmup + steps`` steps on this lab: each timed step's seconds (the
    slowest rank's), and the memory of one more step, tracked as the dry run tracks it. With
    ``reference`` (a calibration's plan), each timed step is preceded and followed by one micro-batch
    of that plan's whole model alone on every rank, timed as ``compute_rate`` times it: the lab's
    compute as it was beside each step, on a machine whose load moves."""
    if plan["gpus"] != dist.get_world_size():
        raise ValueError(f"the plan is for {plan['gpus']} GPUs and this lab has {dist.get_world_size()} ranks: "
                         f"make the plan with gpus={dist.get_world_size()}")
    cfg, mesh, modules = _parallelized(plan)
    params = [p for m in modules for p in m.parameters()]
    optimizer = (DistributedAdamW(params, mesh.get_group("dp_replicate"), lr=1e-4, foreach=True)
                 if plan["dp"] == "zero1" else torch.optim.AdamW(params, lr=1e-4, foreach=True))
    count = micro_batches(plan)
    whole = _whole_model_step(reference) if reference is not None else None
    torch.manual_seed(1)  # the same tokens on every rank: tensor-parallel ranks must share their input
    seconds, beside = [], []
    for i in range(warmup + steps):
        if whole is not None and i >= warmup:
            beside.append(_timed(whole, 1, slowest=True, warm=i == warmup))
        dist.barrier()
        start = time.perf_counter()
        _step(plan, cfg, modules, optimizer, count)
        took = _slowest_s(time.perf_counter() - start)
        if i >= warmup:
            seconds.append(took)
            if whole is not None:
                beside.append(_timed(whole, 1, slowest=True, warm=False))
    with _LocalOpTime() as counted:  # the ops DTensor dispatches, against the dry run's count
        backward(micro_batch(plan, cfg, modules, plan["tp"] > 1), plan["tp"] > 1)
    optimizer.zero_grad(set_to_none=True)
    memory = tracked_step(plan, cfg, modules, optimizer)
    optimizer.zero_grad(set_to_none=True)
    return {"step_s": seconds, "memory": memory, "micro_batches": count,
            "dtensor_ops_per_micro_batch": counted.dtensor_ops, "reference_s": beside}


def _timed(
    work: Callable[[], object], repeats: int, group: dist.ProcessGroup | None = None, slowest: bool = False,
    before: Callable[[], object] | None = None, warm: bool = True,
) -> float:
    """The median seconds of ``work()`` over ``repeats`` runs, every rank (of ``group``) running at once;
    with ``slowest``, each run's time is its slowest rank's (the same on every rank); ``before()`` runs
    untimed ahead of each; ``warm``: one untimed run first (first-call allocations, thread pools)."""
    if warm:
        work()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if before is not None:
            before()
        start = time.perf_counter()
        work()
        took = time.perf_counter() - start
        times.append(_slowest_s(took, group) if slowest else took)
    return statistics.median(times)


def _whole_model_step(plan: PlanJSON) -> Callable[[], None]:
    """One micro-batch's forward and backward of ``plan``'s whole model on this rank alone (no
    parallelism, no collective): the calibration's measure of the lab's compute."""
    cfg, modules = _whole_model(plan)
    torch.manual_seed(1)
    return _micro_batch_step({**plan, "tp": 1, "sequence_parallel": False}, cfg, modules)


def compute_rate(plan: PlanJSON, size: int = 1024, repeats: int = 5) -> dict[str, float]:
    """This rank's fp32 matmul rate (``size`` x ``size`` matrices) and the rate it reaches on one
    micro-batch's forward and backward of ``plan``'s whole model (no parallelism, no collective),
    every rank at once; FLOPs by torch's formulas, as the dry run counts them."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    matmul_s = _timed(lambda: torch.mm(a, b), repeats * 4)
    step = _whole_model_step(plan)
    # Each run's slowest rank, as a plan's step waits for its slowest rank: on a loaded machine the
    # ranks' shares of the cores differ from one moment to the next, and a step meets the worst of them.
    model_s = _timed(step, repeats, slowest=True)
    counter = LocalFlops()  # the dry run's own count (outside FakeTensor: every op here is this rank's)
    with counter:
        step()
    # The machine's memory, shared by the ranks on it (torchrun's LOCAL_WORLD_SIZE, which the lab sets).
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return {"matmul_flops_per_s": 2 * size**3 / matmul_s, "model_flops": float(counter.flops),
            "model_s": model_s, "memory_bytes": float(memory)}


def collective_times(
    sizes: list[int], ranks: list[int] | None = None, ops: tuple[str, ...] = ("all_reduce",), repeats: int = 5,
    after: int = 0,
) -> dict[str, dict[int, float]]:
    """Median seconds of each collective in ``ops`` ("all_reduce", "all_gather", "reduce_scatter") at each
    size in bytes (the whole tensor: what an all-gather makes, what a reduce-scatter reduces; fp32) among
    ``ranks`` (all by default). Every rank calls it (a new group is made by all); the others return nothing.

    ``after``: each timed call comes after that many matmuls on every rank (``_burst``'s, about 1.7 ms
    each here), as a step's collectives come after compute: its time then holds what a step meets and
    calls back to back do not (the peer still finishing its share, gloo's threads woken from sleep)."""
    group = None if ranks is None or len(ranks) == dist.get_world_size() else dist.new_group(ranks)
    if ranks is not None and dist.get_rank() not in ranks:
        return {}
    n = dist.get_world_size(group)
    burst = _burst(after)
    times: dict[str, dict[int, float]] = {}
    for op in ops:
        times[op] = {}
        for size in sizes:
            whole = torch.ones(max(n, size // 4 // n * n))
            part = torch.ones(whole.numel() // n)
            times[op][size] = _timed(_collective(op, whole, part, group), repeats, group, before=burst)
    return times


def _burst(matmuls: int) -> Callable[[], object] | None:
    """``matmuls`` matmuls of a block's shape on a lab (256 x 256 by 256 x 1024, 134 MFLOP each)."""
    if not matmuls:
        return None
    a, b = torch.randn(256, 256), torch.randn(256, 1024)
    return lambda: [torch.mm(a, b) for _ in range(matmuls)]


def _collective(
    op: str, whole: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup | None
) -> Callable[[], object]:
    if op == "all_gather":
        return partial(dist.all_gather_single, whole, part, group=group)
    if op == "reduce_scatter":
        return partial(dist.reduce_scatter_single, part, whole, group=group)
    return partial(dist.all_reduce, whole, group=group)


def copy_rate(size: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes per second one rank moves copying ``size`` bytes (read and written), every rank at once."""
    src, dst = torch.ones(size // 4), torch.empty(size // 4)
    return 2 * size / _timed(lambda: dst.copy_(src), repeats)


class _LocalOpTime(DispatchMode):
    """The seconds spent in local ops (kernels, collectives and their waits), and DTensor's op count:
    what is left of a step's time is its host's Python above them (modules, autograd, DTensor)."""

    def __init__(self) -> None:
        cast("Callable[[], None]", super().__init__)()  # TorchDispatchMode's, unannotated in torch
        self.seconds, self.dtensor_ops = 0.0, 0

    def __torch_dispatch__(
        self, func: Op, types: Sequence[type], args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None
    ) -> object:
        if wrapper_subclass_in(types):
            # Every wrapper subclass's dispatch, DTensor's and funcol's AsyncCollectiveTensor's: on the
            # tests' TP plan 339 and 21 on gloo, the 360 the dry run counts as DTensor's alone (why the
            # split differs under the fake process group is not yet read).
            self.dtensor_ops += 1
            return NotImplemented
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - start
        return out


def _host_s(plan: PlanJSON, cfg: ModelConfig, modules: list[TransformerStage], repeats: int) -> tuple[float, int]:
    """Seconds one micro-batch's forward and backward spends above its local ops (the median over
    ``repeats``), and the DTensor ops it dispatches."""
    step = _micro_batch_step(plan, cfg, modules)
    whole = _timed(step, repeats)  # untimed ops: the timing's own calls kept out of the step's time
    local = []
    for _ in range(repeats):
        dist.barrier()
        with _LocalOpTime() as timing:
            step()
        local.append(timing.seconds)
    return max(0.0, whole - statistics.median(local)), timing.dtensor_ops


def dtensor_host_s(plan: PlanJSON, repeats: int = 5) -> float:
    """The host's seconds per op DTensor dispatches beyond its local ops, on ``plan`` (a model too small
    for its kernels to matter, tensor-parallel over the lab): the time its micro-batch spends above its
    local ops, less what the same model spends there whole and alone (modules and autograd, which the
    compute's efficiency already holds), over the DTensor ops it dispatched."""
    cfg, _, modules = _parallelized(plan)
    _, alone_modules = _whole_model(plan)
    torch.manual_seed(1)  # the same tokens on every rank: tensor-parallel ranks must share their input
    split, ops = _host_s(plan, cfg, modules, repeats)
    alone, _ = _host_s({**plan, "tp": 1, "sequence_parallel": False}, cfg, alone_modules, repeats)
    return max(0.0, split - alone) / max(ops, 1)
