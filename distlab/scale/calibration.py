"""The predictor's machine, measured on a lab, and a plan run for real on that lab: the check of the model.

    cal = scale.calibrate(lab)                        # the lab as scale.Hardware and scale.Network
    plan = scale.Plan(model=cal.plan.config, gpus=lab.world_size, tp=2, seq_len=256, global_batch_tokens=2048,
                      precision="fp32")
    pred = scale.predict(plan, hardware=cal.hardware, network=cal.network)
    run = scale.measure(lab, plan)                    # the same code, on the lab's ranks, timed and weighed
    run.step_time_s, run.memory["peak"]               # against pred.step_time_s, pred.memory_per_gpu_bytes

What ``calibrate`` measures, every rank at once (they share the machine as a plan's ranks do), and
what it makes of it:

- **compute**: the peak is a rank's fp32 matmul rate (1024 x 1024); the efficiency is the fraction of
  it the calibration plan's model reaches, whole and alone on every rank (one micro-batch's forward
  and backward, no collective; FLOPs by torch's formulas, as the dry run counts them), each run timed
  as its slowest rank's, since a plan's step waits for its slowest rank. Nothing in it is taken from
  the plans it is then used to predict.
- **links**: all-reduces, all-gathers and reduce-scatters from 64 KiB to 16 MiB on the lab's group,
  each call timed as a step meets it: after a few milliseconds of compute on every rank (``_AFTER``).
  Back to back, gloo's threads stay awake and no rank is still finishing its share; inside a
  tensor-parallel micro-batch the same calls took 1.5-3x as long. Each op is fitted to the ring model
  (``theory.collective_time_s``; for the all-reduce ``2(N-1) a + 2(N-1)/N S / B``) by least squares,
  giving its latency ``a`` and bandwidth ``B``. Op by op, because gloo's reduce-scatter reduces the
  whole tensor (notebook 14 counts its bytes): twice the ring's time. On a lab with emulated nodes
  the network is fitted on one rank per node and the node's own link on the ranks of the first node;
  a lab on one machine has only the node's link (loopback), and its network is the same fit.
- **memory bandwidth**: a rank's copy rate, read and written, for the optimizer's step.
- **DTensor's host time**: each op DTensor dispatches runs Python of its own (its sharding's
  propagation, redistributions, wrapping) before its local ops; CPU ranks run that and their kernels
  in turn, so a tensor-parallel plan's step waits for it. Measured on a model too small for its
  kernels to matter (``_host_probe``: the calibration model's layers and op mix, a few dozen wide),
  tensor-parallel over pairs of ranks: the time one micro-batch spends above its local ops, less what the
  same model spends there whole and alone, over the ops DTensor dispatched. The dry run counts a plan's
  DTensor ops; the predictor charges each this much (``Hardware.host_s_per_dtensor_op``).
- **overlap**: none on CPU ranks. FSDP2 (and the replicate mode the dry run's DDP is) calls each
  collective synchronously and gets its overlap from CUDA streams, which a CPU device does not have:
  every all-gather and reduce-scatter is waited for where it is issued. (Measured here beside it: an
  8 MiB all-reduce launched asynchronously with as many matmuls beside it took 26 ms, against 7 ms and
  6-9 ms for the two alone, so running them at once would cost, not save.) A GPU lab overlaps.

``measure`` runs the plan's code (``rank.planrun``: the dry run's ``parallelize``, ``micro_batch``,
``backward`` and ``tracked_step``) on the lab's process group with real weights, at the lab's world
size: warm-up steps, then timed steps, each the slowest rank's, and one step's memory tracked as the
dry run tracks it. Pipeline parallelism is not run (its schedules are not the dry run's code).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from .. import checks
from ..errors import LabUsageError
from ..theory import fit_latency_bandwidth
from .hardware import Hardware, Network
from .models import ModelConfig
from .plan import Plan

__all__ = ["CALIBRATION_MODEL", "Calibration", "Measurement", "calibrate", "measure"]

#: The calibration plan's model: small enough for a 2-core lab to run in seconds, large enough that
#: its matmuls, not Python, take the time (a Llama block: 256 wide, 8 heads, SwiGLU of 704).
CALIBRATION_MODEL = ModelConfig("lab-llama", "llama", 256, 4, 8, 8, 704, 2048, 1024)


def _host_probe(ranks: int) -> Plan:
    """The plan ``dtensor_host_s`` times: the calibration model's four Llama blocks, a few dozen wide,
    tensor-parallel over pairs of ranks (over all of them where their number is odd), sequence
    parallel, FSDP over the pairs, as a TP plan runs."""
    tp = 2 if ranks % 2 == 0 else ranks
    tiny = ModelConfig("host-probe", "llama", 32 * tp, 4, 2 * tp, tp, 24 * tp, 64 * tp, 1024)
    return Plan(model=tiny, gpus=ranks, tp=tp, seq_len=8 * tp, micro_batch_size=4,
                global_batch_tokens=8 * tp * 4 * (ranks // tp), precision="fp32")


_SIZES = [2**16, 2**18, 2**20, 2**22, 2**24]  # each collective's sizes for the link's fit, bytes
#: Each timed collective comes after this many block-shaped matmuls on every rank (a few milliseconds
#: of compute, a block's share of a step between two of its collectives on a lab): measured inside a
#: tensor-parallel micro-batch, the calls took 1.5-3x what the same calls take back to back.
_AFTER = 4


@dataclass(frozen=True)
class Calibration:
    """A lab's machine for ``scale.predict`` (``hardware=``, ``network=``), and how it was measured."""

    hardware: Hardware
    network: Network
    plan: Plan  # the calibration plan (its model, sequence and micro-batch)
    #: What was measured: matmul rate, the model's rate, copy rate, and each link's timed sizes.
    measured: dict[str, object] = field(default_factory=dict)

    @property
    def efficiency(self) -> float:
        return float(self.hardware.efficiency or 0.0)

    def __str__(self) -> str:
        h, n = self.hardware, self.network
        return (
            f"{h.name}: peak {h.peak_flops['fp32'] / 1e9:.1f} GFLOP/s per rank (fp32 matmul), efficiency "
            f"{100 * self.efficiency:.0f}% on {self.plan.config.name}; node link "
            f"{h.node_link_bytes_per_s / 1e9:.2f} GB/s "
            f"+ {1e6 * h.node_link_latency_s:.0f} us a step; network {n.bytes_per_s / 1e9:.2f} GB/s + "
            f"{1e6 * n.latency_s:.0f} us (all-reduce; "
            + ", ".join(f"{op} {bw / 1e9:.2f} GB/s" for op, (bw, _) in h.node_link_by_op.items() if op != "all_reduce")
            + f"); compute hides {100 * h.overlap:.0f}% of a collective beside it; DTensor's host "
            f"{1e6 * h.host_s_per_dtensor_op:.0f} us an op; memory "
            f"{h.memory_bytes_per_s / 1e9:.1f} GB/s"
        )


@dataclass(frozen=True)
class Measurement:
    """A plan run on a lab: each timed step's seconds (the slowest rank's) and one step's memory on the
    hungriest rank, by category (``DryRunReport``'s)."""

    plan: Plan
    step_times_s: list[float]
    memory: dict[str, int]
    micro_batches: int
    #: The ops DTensor dispatched in one micro-batch (tensor parallelism's): the dry run counts them too.
    dtensor_ops_per_micro_batch: int = 0
    #: With ``measure(..., calibration=)``: that calibration with its compute measured again beside the
    #: timed steps (its model alone on every rank before and after each): the lab as they met it.
    calibration: Calibration | None = None

    @property
    def step_time_s(self) -> float:
        """The median step."""
        return statistics.median(self.step_times_s)

    @property
    def spread(self) -> tuple[float, float]:
        """The fastest and the slowest step."""
        return min(self.step_times_s), max(self.step_times_s)


class _RankRow(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def device(self) -> str: ...


class _Lab(Protocol):
    """What calibrate and measure ask of a lab (the ``Lab`` a person uses has it)."""

    @property
    def world_size(self) -> int: ...
    def run(
        self, code: str, *, timeout: float | None = ..., stream: bool = ..., record: bool = ...
    ) -> Mapping[int, Any]: ...
    def status(self) -> Sequence[_RankRow]: ...


def _lab(lab: _Lab, what: str) -> _Lab:
    if not all(hasattr(lab, name) for name in ("run", "status", "world_size")):
        raise TypeError(f"{what} takes a running lab, like scale.{what}(distlab.current_lab()); got {lab!r}")
    return lab


def _on_ranks(lab: _Lab, call: str, timeout: float) -> dict[int, Any]:
    """``distlab.rank.planrun.<call>`` on every rank: {rank: what it returned}."""
    code = f"from distlab.rank import planrun as _planrun\n_planrun.{call}"
    return dict(lab.run(code, stream=False, record=False, timeout=timeout))


_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _fits(times: dict[str, dict[int, float]], ranks: int) -> dict[str, tuple[float, float]]:
    """{op: (bandwidth bytes/s, latency s)} of the ring model fitted to each op's ``times`` {bytes: seconds}."""
    found = {}
    for op, by_size in times.items():
        fit = fit_latency_bandwidth(list(by_size.items()), workers=ranks, op=op)
        found[op] = (fit.bandwidth_bytes_per_s, fit.latency_s)
    return found


def calibrate(lab: _Lab, plan: Plan | None = None, timeout: float = 300) -> Calibration:
    """The lab as a machine the predictor knows (module doc): ``hardware=`` and ``network=`` for
    ``scale.predict``. ``plan``: whose model (with its sequence length and micro-batch) the efficiency
    is measured on; by default ``CALIBRATION_MODEL`` at 256 tokens, 4 sequences per micro-batch, fp32."""
    lab = _lab(lab, "calibrate")
    ranks = int(lab.world_size)
    if ranks < 2:
        raise LabUsageError("calibrate needs at least 2 ranks to time the links: start the lab with -n 2 or more")
    if plan is None:
        plan = Plan(model=CALIBRATION_MODEL, gpus=ranks, seq_len=256, micro_batch_size=4,
                    global_batch_tokens=256 * 4 * ranks, precision="fp32")
    checks.instance("plan", plan, Plan, what="a scale.Plan", error=TypeError)
    if plan.precision != "fp32":
        raise LabUsageError(f"precision={plan.precision!r}: a lab's CPU ranks are calibrated in fp32; make the plan "
                            "with precision='fp32'")
    as_json = json.dumps(plan.to_json())
    compute = _on_ranks(lab, f"compute_rate(__import__('json').loads({as_json!r}))", timeout)
    copy = _on_ranks(lab, "copy_rate()", timeout)
    rows = lab.status()
    on_cpu = all(row.device.startswith("cpu") for row in rows)
    # A GPU's host queues kernels ahead of the device: its DTensor time hides behind them.
    probe = json.dumps(_host_probe(ranks).to_json())
    host = _on_ranks(lab, f"dtensor_host_s(__import__('json').loads({probe!r}))", timeout) if on_cpu else {}
    hosts: dict[str, list[int]] = {}
    for row in rows:
        hosts.setdefault(row.host, []).append(row.rank)
    first = next(iter(hosts.values()))
    heads = [members[0] for members in hosts.values()]
    links: dict[str, dict[str, tuple[float, float]]] = {}
    timed: dict[str, dict[str, dict[int, float]]] = {}
    for name, members in (("node", first), ("network", heads)):
        if len(members) >= 2:
            got = _on_ranks(lab, f"collective_times({_SIZES!r}, ranks={members!r}, ops={_OPS!r}, after={_AFTER})",
                            timeout)
            slowest = {op: {size: max(got[r][op][size] for r in members) for size in _SIZES} for op in _OPS}
            timed[name] = slowest
            links[name] = _fits(slowest, len(members))
    node = links.get("node") or links["network"]
    network = links.get("network") or node
    # FSDP2 calls its collectives synchronously and overlaps them with compute through CUDA streams
    # (torch's _fsdp_collectives.foreach_reduce: the reduce-scatter inside device_handle.stream(...),
    # async_op=False; all-gathers likewise unless prefetched): on CPU ranks, which have no streams,
    # each one is waited for where it is issued. A GPU lab's collectives run beside its compute.
    overlap = 0.0 if on_cpu else 1.0
    reached = statistics.median(c["model_flops"] / c["model_s"] for c in compute.values())
    peak = _peak(reached, statistics.median(c["matmul_flops_per_s"] for c in compute.values()))
    hardware = Hardware(
        name="this lab",
        peak_flops={"fp32": peak},
        memory_bytes=min(c["memory_bytes"] for c in compute.values()),
        memory_bytes_per_s=statistics.median(copy.values()),
        gpus_per_node=max(len(m) for m in hosts.values()),
        node_link_bytes_per_s=node["all_reduce"][0],
        node_link_latency_s=node["all_reduce"][1],
        source=f"scale.calibrate on {ranks} ranks: fp32 matmul rate, {plan.config.name}'s forward and backward, "
        "copy rate, collectives fitted to the ring model, DTensor's host time per op",
        efficiency=reached / peak,
        overlap=overlap,
        node_link_by_op=node,
        host_s_per_dtensor_op=statistics.median(host.values()) if host else 0.0,
    )
    net = Network(name="this lab's network" if "network" in links else "this lab (one machine: no network)",
                  bytes_per_s=network["all_reduce"][0], latency_s=network["all_reduce"][1], source=hardware.source,
                  by_op=network)
    measured = {"compute": compute, "copy_bytes_per_s": copy, "collective_s": timed, "dtensor_host_s": host}
    return Calibration(hardware=hardware, network=net, plan=plan, measured=measured)


def measure(
    lab: _Lab, plan: Plan, steps: int = 5, warmup: int = 2, timeout: float = 600,
    calibration: Calibration | None = None,
) -> Measurement:
    """``plan`` run on ``lab`` (module doc): ``steps`` timed steps after ``warmup``, and one step's memory.

    With ``calibration`` (``scale.calibrate``'s, on this lab), each timed step is preceded and followed
    by one micro-batch of the calibration's model alone on every rank, and ``Measurement.calibration`` is that
    calibration with its compute as measured there: a prediction on its ``hardware`` is checked against
    the machine as it was during the steps, not as it was when ``calibrate`` ran (a shared machine's
    load moves the compute's rate by a third between runs)."""
    lab = _lab(lab, "measure")
    checks.instance("plan", plan, Plan, what="a scale.Plan", error=TypeError)
    checks.whole("steps", steps, minimum=1, example="scale.measure(lab, plan, steps=5)")
    checks.whole("warmup", warmup, minimum=0, example="scale.measure(lab, plan, warmup=2)")
    if plan.gpus != lab.world_size:
        raise LabUsageError(f"the plan is for gpus={plan.gpus} and the lab has {lab.world_size} ranks: make the plan "
                            f"with gpus={lab.world_size}")
    if plan.pp > 1 or plan.cp > 1:
        raise LabUsageError("scale.measure runs plans with pp=1 and cp=1: a pipeline's schedule is not the dry run's "
                            "code (its stages are dry-run alone); measure the plan without pp")
    if plan.precision != "fp32":
        raise LabUsageError(f"precision={plan.precision!r}: a lab's CPU ranks run fp32; make the plan with "
                            "precision='fp32'")
    if calibration is not None:
        checks.instance("calibration", calibration, Calibration, what="scale.calibrate(lab)'s", error=TypeError)
    as_json = json.dumps(plan.to_json())
    reference = ("None" if calibration is None
                 else f"__import__('json').loads({json.dumps(calibration.plan.to_json())!r})")
    got = _on_ranks(lab, f"run_plan(__import__('json').loads({as_json!r}), {steps}, {warmup}, reference={reference})",
                    timeout)
    hungriest = max(got.values(), key=lambda r: r["memory"]["peak"])
    return Measurement(plan=plan, step_times_s=list(got[0]["step_s"]), memory=dict(hungriest["memory"]),
                       micro_batches=int(got[0]["micro_batches"]),
                       dtensor_ops_per_micro_batch=int(got[0]["dtensor_ops_per_micro_batch"]),
                       calibration=_beside(calibration, got[0]["reference_s"]) if calibration is not None else None)


def _peak(reached: float, matmul: float) -> float:
    """The lab's peak: its matmul rate, or the model's own rate ``reached`` where that is higher. The
    model's rate is what the compute is predicted at (FLOPs over peak x efficiency); a loaded machine
    can time the matmul slower than the model."""
    return max(reached, matmul)


def _beside(calibration: Calibration, reference_s: list[float]) -> Calibration:
    """``calibration`` with its compute's rate from ``reference_s`` (its model's micro-batch, each timed
    beside a step, the slowest rank's) instead of its own timing."""
    compute = cast("dict[int, dict[str, float]]", calibration.measured["compute"])
    flops = statistics.median(c["model_flops"] for c in compute.values())
    reached = flops / statistics.median(reference_s)
    hw = calibration.hardware
    peak = _peak(reached, hw.peak_flops["fp32"])
    hardware = dataclasses.replace(hw, peak_flops={**hw.peak_flops, "fp32": peak}, efficiency=reached / peak,
                                   source=hw.source + "; compute timed again beside a plan's steps")
    return dataclasses.replace(calibration, hardware=hardware,
                               measured={**calibration.measured, "beside_steps_s": list(reference_s)})
