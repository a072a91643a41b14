"""scale.predict's model of time on a hand-made dry-run report whose answer is known by construction,
and the hardware profiles' bad names."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace as NS

import pytest

from distlab.scale import hardware
from distlab.scale import prediction as predict
from distlab.theory import algorithm_times, collective_time_s, nccl_collective_time_s

H100 = hardware.HARDWARE["h100-sxm"]
IB = hardware.NETWORKS["ib-400g"]
PEAK = H100.peak_flops["bf16"]
MATMUL = H100.kernel_rates.matmul  # the fraction of the peak a large matmul reaches on it


def _plan(**kw):
    base = {"gpus": 16, "tp": 8, "pp": 1, "cp": 1, "dp": "fsdp", "shard": None, "precision": "bf16",
            "schedule": "1f1b", "chunks": 1, "fused_kernels": False}
    return NS(**{**base, **kw})


def _kind(flops_s=0.1, collectives=(), ranks=16, memory=None):
    # flops_s: the micro-batch's compute time at efficiency 0.5 on an H100, all of it matmuls.
    return NS(
        name="every rank", ranks=ranks, rank=0, stage=None, flops_per_micro_batch=flops_s * PEAK * MATMUL * 0.5,
        recompute_flops_per_micro_batch=0.0, fp8_flops_per_micro_batch=0.0, attention_flops_per_micro_batch=0.0,
        streamed_bytes_per_micro_batch=0.0, fused_bytes_per_micro_batch=0.0, dtensor_ops_per_micro_batch=0.0,
        collectives=list(collectives),
        memory=memory or {"parameters": 1e9, "gradients": 1e9, "optimizer": 2e9, "activations": 5e9, "peak": 9e9},
    )


def _c(op, dim, group_size, nbytes, calls=1, phase="forward"):
    return NS(op=op, dim=dim, group_size=group_size, bytes=nbytes, calls_per_micro_batch=calls, phase=phase)


def _nccl(op, size, n, per_node):
    """What the algorithm NCCL picks costs on the H100 profile over the IB network."""
    return nccl_collective_time_s(op, size, n, per_node, H100.node_link_bytes_per_s, H100.node_link_latency_s,
                                  IB.bytes_per_s, IB.latency_s, nvls=H100.nvls)


def test_each_dimension_runs_on_the_link_its_groups_span():
    # 16 GPUs, tp 8 innermost: a tp group is one node; the dp groups (ranks 8 apart) cross nodes.
    assert predict.links(_plan(), H100) == {
        "pp": "none", "dp_replicate": "none", "dp_shard": "network", "cp": "none", "tp": "node"}
    # tp 2, fsdp 8: a dp_shard group spans 16 ranks: the network; with hsdp shard 4, 8 ranks: a node.
    assert predict.links(_plan(tp=2), H100)["dp_shard"] == "network"
    assert predict.links(_plan(tp=2, dp="hsdp", shard=4), H100)["dp_shard"] == "node"
    assert predict.links(_plan(tp=2, dp="hsdp", shard=4), H100)["dp_replicate"] == "network"


def test_dtensors_host_time_is_charged_per_op_where_the_host_and_the_kernels_take_turns():
    kind = _kind(0.1)
    kind.dtensor_ops_per_micro_batch = 600.0
    report = NS(plan=_plan(), micro_batches=4, tokens_per_step=4 * 8192 * 2, kinds=[kind])
    on_gpu = predict.predict_report(report, "h100-sxm", "ib-400g", efficiency=0.5)
    assert "DTensor's host time" not in on_gpu.breakdown  # queued ahead of the kernels: hidden
    lab = dataclasses.replace(H100, name="a CPU lab", host_s_per_dtensor_op=50e-6)
    on_lab = predict.predict_report(report, lab, "ib-400g", efficiency=0.5)
    assert on_lab.breakdown["DTensor's host time"] == pytest.approx(4 * 600 * 50e-6)
    assert on_lab.step_time_s == pytest.approx(on_gpu.step_time_s + 4 * 600 * 50e-6)


def test_tensor_parallel_time_is_exposed_and_fsdp_hides_behind_compute_but_for_one_call():
    tp = _c("all_reduce", "tp", 8, 64 * 2**20, calls=4)
    gather = _c("all_gather", "dp_shard", 2, 8 * 2**20, calls=10)
    report = NS(plan=_plan(), micro_batches=4, tokens_per_step=4 * 8192 * 2, kinds=[_kind(0.1, [tp, gather])])
    pred = predict.predict_report(report, "h100-sxm", "ib-400g", efficiency=0.5)
    tp_s = 4 * _nccl("all_reduce", 64 * 2**20, 8, 8)  # a node's NVSwitch reduces (NVLS)
    one_gather = _nccl("all_gather", 16 * 2**20, 2, 1)  # the dp_shard group: one rank on each of 2 nodes
    assert pred.algorithms == {"dp_shard all_gather": "ring", "tp all_reduce": "nvls"}
    assert 10 * one_gather < 0.1  # the all-gathers hide behind the compute...
    optimizer = 2 * 4e9 / H100.memory_bytes_per_s
    expected = 4 * (0.1 + tp_s + one_gather) + optimizer  # ...but for the first
    assert pred.step_time_s == pytest.approx(expected, rel=1e-9)
    assert sum(pred.breakdown.values()) == pytest.approx(pred.step_time_s, rel=1e-9)
    assert pred.tokens_per_s_per_gpu == pytest.approx(4 * 8192 * 2 / expected / 16)
    assert pred.mfu == pytest.approx(4 * 0.1 * 0.5 * MATMUL / expected)
    assert pred.memory_per_gpu_bytes == 9e9


def test_a_machine_that_overlaps_nothing_exposes_every_collective_and_per_op_links_are_used():
    # A calibrated lab's hardware (scale.calibrate): its cores run both compute and collectives, its
    # reduce-scatter has a bandwidth of its own, and its efficiency is its own.
    from dataclasses import replace

    gather = _c("all_gather", "dp_shard", 2, 8 * 2**20, calls=10)
    scatter = _c("reduce_scatter", "dp_shard", 2, 16 * 2**20, calls=5, phase="backward")
    report = NS(plan=_plan(tp=1, gpus=2), micro_batches=2, tokens_per_step=2 * 8192,
                kinds=[_kind(0.1, [gather, scatter], ranks=2)])
    lab = replace(H100, gpus_per_node=2, overlap=0.0, efficiency=0.5, kernel_rates=None,
                  node_link_by_op={"reduce_scatter": (1e9, 1e-4)}, nccl=False, nvls=False)
    pred = predict.predict_report(report, lab, "ib-400g")
    assert pred.efficiency == 0.5  # the hardware's own, not the published fit
    assert pred.algorithms == {}  # gloo's rings: no algorithm chosen
    gathers = 10 * collective_time_s("all_gather", 16 * 2**20, 2, H100.node_link_bytes_per_s, H100.node_link_latency_s)
    scatters = 5 * collective_time_s("reduce_scatter", 16 * 2**20, 2, 1e9, 1e-4)
    assert pred.breakdown["exposed dp_shard"] == pytest.approx(2 * (gathers + scatters), rel=1e-9)
    # Overlapping fully, the same collectives hide behind the 0.1 s of compute but for one call.
    full = predict.predict_report(report, replace(lab, overlap=1.0), "ib-400g")
    assert full.breakdown["exposed dp_shard"] == pytest.approx(2 * (gathers + scatters) / 15, rel=1e-9)


def test_a_pipeline_pays_its_bubble():
    plan = _plan(gpus=32, pp=4, tp=8, dp="fsdp")
    kinds = [_kind(0.1, ranks=8), _kind(0.12, ranks=8), _kind(0.1, ranks=16)]
    report = NS(plan=plan, micro_batches=8, tokens_per_step=8 * 8192, kinds=kinds)
    pred = predict.predict_report(report, efficiency=0.5)
    # 1F1B: (m + p - 1) of the slowest stage's micro-batch time: 11 x 0.12 s, 3 x 0.12 of it the bubble.
    assert pred.breakdown["bubble"] == pytest.approx(3 * 0.12)
    busy = pred.step_time_s - pred.breakdown["optimizer step"]
    assert busy == pytest.approx(11 * 0.12)
    inter = predict.predict_report(NS(plan=_plan(gpus=32, pp=4, schedule="interleaved", chunks=2), micro_batches=8,
                                      tokens_per_step=8 * 8192, kinds=kinds), efficiency=0.5)
    assert inter.breakdown["bubble"] == pytest.approx(1.5 * 0.12)  # (p-1)/v


def test_under_a_pipeline_fsdp_gathers_and_reduces_once_a_step_not_per_micro_batch():
    # torch's schedules keep FSDP's parameters gathered and reduce the gradients after a stage's last
    # micro-batch: 8 micro-batches pay the dp_shard collectives once.
    gather = _c("all_gather", "dp_shard", 4, 8 * 2**20, calls=3)
    scatter = _c("reduce_scatter", "dp_shard", 4, 32 * 2**20, calls=3, phase="backward")
    plan = _plan(gpus=32, pp=2, tp=4, dp="fsdp")
    kinds = [_kind(0.1, [gather, scatter], ranks=16), _kind(0.1, [gather, scatter], ranks=16)]
    pred = predict.predict_report(NS(plan=plan, micro_batches=8, tokens_per_step=8 * 8192, kinds=kinds),
                                  efficiency=0.5)
    # tp 4 innermost: a dp_shard group of 4 has 2 ranks on each of 2 nodes
    assert predict.ranks_per_node(plan, H100)["dp_shard"] == 2
    one_gather = _nccl("all_gather", 32 * 2**20, 4, 2)
    scatters = 3 * _nccl("reduce_scatter", 32 * 2**20, 4, 2)
    assert "exposed dp_shard" not in pred.breakdown  # nothing per micro-batch
    assert pred.breakdown["exposed dp_shard (once a step)"] == pytest.approx(one_gather + scatters, rel=1e-9)
    busy = pred.step_time_s - pred.breakdown["optimizer step"] - pred.breakdown["exposed dp_shard (once a step)"]
    assert busy == pytest.approx(9 * 0.1)  # (m + p - 1) micro-batch times of compute alone
    assert sum(pred.breakdown.values()) == pytest.approx(pred.step_time_s, rel=1e-9)


def test_each_collective_costs_the_algorithm_nccl_would_pick_for_its_group_at_1024_gpus():
    # DDP over 1,024 GPUs (8 on each of 128 nodes): a 25 MiB bucket's all-reduce runs on a tree, whose
    # latency is 2 (7 NVLink + 7 network) hops, where a ring pays 2 x 1,023 steps; FSDP under TP 8 (one
    # rank of each group per node) gathers its small shards with PAT.
    ddp = _plan(gpus=1024, tp=1, dp="ddp")
    assert predict.ranks_per_node(ddp, H100)["dp_replicate"] == 8
    bucket = _c("all_reduce", "dp_replicate", 1024, 25 * 2**20, calls=40, phase="backward")
    pred = predict.predict_report(NS(plan=ddp, micro_batches=1, tokens_per_step=8192, kinds=[_kind(0.1, [bucket])]),
                                  efficiency=0.5)
    assert pred.algorithms == {"dp_replicate all_reduce": "tree"}
    times = {a.algorithm: a.seconds for a in algorithm_times(
        "all_reduce", 25 * 2**20, 1024, 8, H100.node_link_bytes_per_s, H100.node_link_latency_s, IB.bytes_per_s,
        IB.latency_s, nvls=True)}
    assert times["tree"] < times["ring"] - 5e-3  # the ring's 2,046 steps cost milliseconds more
    fsdp = _plan(gpus=1024, tp=8)
    assert predict.ranks_per_node(fsdp, H100) == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 8}
    gather = _c("all_gather", "dp_shard", 128, 2**20 // 128, calls=32)
    pred = predict.predict_report(NS(plan=fsdp, micro_batches=1, tokens_per_step=8192, kinds=[_kind(0.1, [gather])]),
                                  efficiency=0.5)
    assert pred.algorithms == {"dp_shard all_gather": "pat"}


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda: hardware.hardware_named("h100"), "hardware must be one of a100-sxm, h100-500w, h100-sxm, h200"),
        (lambda: hardware.network_named("ib400"), "network must be one of ib-200g, ib-400g, roce-400g (did you mean"),
        (lambda: predict.predict_report(NS(plan=_plan(), micro_batches=1, tokens_per_step=1, kinds=[_kind()]),
                                        efficiency=1.5), "efficiency must be in (0, 1]"),
    ],
)
def test_bad_input_gets_one_line(call, says):
    with pytest.raises(ValueError) as info:
        call()
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_plan_over_the_gpus_memory_says_so_in_one_line_with_what_takes_the_room():
    report = NS(plan=_plan(), micro_batches=4, tokens_per_step=4 * 8192 * 2, kinds=[_kind(0.1)])
    fits = predict.predict_report(report, "h100-sxm", "ib-400g", efficiency=0.5)
    assert fits.fits and fits.fit_note == "" and "\n" not in str(fits)
    states = {"parameters": 20e9, "gradients": 20e9, "optimizer": 40e9, "activations": 10e9, "peak": 100e9}
    report.kinds = [_kind(0.1, memory=states)]
    over = predict.predict_report(report, "h100-sxm", "ib-400g", efficiency=0.5)
    assert not over.fits
    limit = H100.memory_bytes
    assert over.fit_note == (
        f"does not fit: {100e9 / 2**30:.1f} GiB per GPU against the h100-sxm's {limit / 2**30:.1f} GiB (80 GB), "
        f"{100 * (100e9 / limit - 1):.1f}% over; the larger part is parameters, gradients and optimizer states "
        f"({80e9 / 2**30:.1f} GiB): try more GPUs to shard over, or more tp or pp"
    )
    assert str(over).splitlines()[1] == over.fit_note
    activations = {"parameters": 1e9, "gradients": 1e9, "optimizer": 2e9, "activations": 90e9, "peak": 95e9}
    report.kinds = [_kind(0.1, memory=activations)]
    note = predict.predict_report(report, "h100-sxm", "ib-400g", efficiency=0.5).fit_note
    assert "the larger part is activations" in note and "checkpointing='full'" in note
    # the H200's 141 GB holds what the H100's 80 do not
    assert predict.predict_report(report, "h200", "ib-400g", efficiency=0.5).fits


def test_uneven_stages_go_at_the_slowest_ones_pace_and_the_others_fill_and_drain_the_pipeline_once():
    # 4 stages of 7, 8, 8 and 7 layers on 32 GPUs (tp 8 in each): a micro-batch takes 70 ms on the
    # ends' ranks and 80 ms on the middle two.
    plan = _plan(gpus=32, pp=4, layers_per_stage=(7, 8, 8, 7))
    kinds = [_kind(0.07, ranks=8), _kind(0.08, ranks=16), _kind(0.07, ranks=8)]
    report = NS(plan=plan, micro_batches=8, tokens_per_step=8 * 8192 * 1, kinds=kinds)
    pred = predict.predict_report(report, "h100-sxm", "ib-400g", efficiency=0.5)
    optimizer = 2 * 4e9 / H100.memory_bytes_per_s
    busy = 8 * 0.08 + (0.07 + 2 * 0.08 + 0.07 - 0.08)
    assert pred.step_time_s == pytest.approx(busy + optimizer, rel=1e-9)
    assert pred.breakdown["bubble"] == pytest.approx(busy - 8 * 0.08, rel=1e-9)
    # Equal stages give the uniform formula: (m + p - 1) micro-batch times.
    even = predict.predict_report(
        NS(plan=_plan(gpus=32, pp=4, layers_per_stage=(8,) * 4), micro_batches=8, tokens_per_step=8 * 8192,
           kinds=[_kind(0.08, ranks=8), _kind(0.08, ranks=16), _kind(0.08, ranks=8)]),
        "h100-sxm", "ib-400g", efficiency=0.5,
    )
    assert even.step_time_s == pytest.approx((8 + 3) * 0.08 + optimizer, rel=1e-9)


def test_each_kind_of_kernel_runs_at_its_own_rate_and_a_fit_says_where_it_was_made():
    # 2 PFLOP of matmuls, 1 PFLOP of (causal) attention as torch counts it, 3 TB through memory-bound
    # kernels run one an op, 1 TB where each chain of them is fused
    kind = _kind()
    kind.flops_per_micro_batch, kind.attention_flops_per_micro_batch = 3e15, 1e15
    kind.streamed_bytes_per_micro_batch, kind.fused_bytes_per_micro_batch = 3e12, 1e12
    sxm, titan = (hardware.HARDWARE[name] for name in ("h100-sxm", "h100-500w"))
    for part in (sxm, titan):
        for fused in (False, True):
            report = NS(plan=_plan(tp=1, gpus=8, fused_kernels=fused), micro_batches=1, tokens_per_step=8192,
                        kinds=[kind])
            pred = predict.predict_report(report, part, "ib-400g", efficiency=0.5)
            rates = part.kernel_rates
            by_kernel = {"matmuls": 2e15 / (PEAK * rates.matmul) / 0.5,
                         "attention": 0.5e15 / (PEAK * rates.attention) / 0.5,  # the causal half of the square
                         "memory-bound": (1e12 if fused else 3e12) / part.memory_bytes_per_s / 0.5}
            assert pred.compute_by_kernel == pytest.approx(by_kernel, rel=1e-12)
            assert pred.breakdown["compute"] == pytest.approx(sum(by_kernel.values()), rel=1e-12)
    # torchtitan's runs: torch's flash attention (FlashAttention-2) on HBM2e; NVIDIA's: cuDNN's on HBM3
    assert titan.kernel_rates.attention < sxm.kernel_rates.attention
    assert titan.memory_bytes_per_s < sxm.memory_bytes_per_s
    # each H100 profile has its own fit, said; a part with none borrows the SXM's and says so
    assert predict.predict_report(report, titan, "ib-400g").efficiency == titan.efficiency != sxm.efficiency
    assert predict.predict_report(report, sxm, "ib-400g").efficiency_source == sxm.efficiency_source
    a100 = predict.predict_report(report, "a100-sxm", "ib-400g")
    assert a100.efficiency == predict.EFFICIENCY == sxm.efficiency
    assert "not fitted on a100-sxm" in a100.efficiency_source and "not fitted on" in str(a100)
    assert "not fitted on" not in str(predict.predict_report(report, sxm, "ib-400g"))
    assert predict.predict_report(report, sxm, "ib-400g", efficiency=0.4).efficiency_source == "passed to predict"
