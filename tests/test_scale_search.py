"""scale.search: the layouts it lays out and screens (fast), and a search whose dry runs decide (cluster)."""

from __future__ import annotations

import dataclasses

import pytest

from distlab import scale
from distlab.errors import LabUsageError
from distlab.scale.search import SLACK, estimate, layouts

H100 = scale.HARDWARE["h100-sxm"]
TINY = scale.ModelConfig("tiny", "llama", 64, 8, 4, 2, 128, 512, 256, False)


def test_every_layout_fills_the_gpus_keeps_tensor_parallelism_in_a_node_and_splits_the_batch():
    found = layouts("llama3-70b", 1024, H100, 8192, 4 * 2**20)
    assert found
    for plan in found:
        dp = plan.gpus // (plan.tp * plan.pp)
        assert plan.tp * plan.pp * dp == 1024 and plan.tp <= H100.gpus_per_node
        assert plan.micro_batches * plan.micro_batch_size * plan.seq_len * dp == 4 * 2**20
        assert plan.pp == 1 or plan.micro_batches >= plan.pp
    assert {p.checkpointing for p in found} == {"none", "selective", "full"}
    # 4M tokens of 8,192 are 512 sequences: 1,024 data-parallel ranks cannot each take one, and with
    # tp 1 and pp stages, 1,024 / pp ranks would each get pp / 2 of them, fewer than the pipeline's pp
    assert all(p.gpus // (p.tp * p.pp) <= 512 for p in found)
    assert {p.tp for p in found} == {2, 4, 8}


def test_the_estimate_trades_memory_for_time_as_checkpointing_and_splitting_do():
    base: dict = {"model": "llama3-70b", "gpus": 1024, "seq_len": 8192, "global_batch_tokens": 4 * 2**20}
    none, selective, full = (estimate(scale.Plan(**base, tp=8, checkpointing=c), H100) for c in
                             ("none", "selective", "full"))
    assert full.memory_bytes < selective.memory_bytes < none.memory_bytes
    assert none.step_time_s < selective.step_time_s < full.step_time_s
    # more tensor parallelism: less memory per GPU, and its all-reduces on the node's link cost time
    tp2, tp8 = (estimate(scale.Plan(**base, tp=t, checkpointing="full"), H100) for t in (2, 8))
    assert tp8.memory_bytes < tp2.memory_bytes and tp8.step_time_s > tp2.step_time_s
    # Llama 3 8B with FSDP alone on 128 GPUs (torchtitan's row: 67 GiB published, no checkpointing)
    row = estimate(scale.Plan(model="llama3-8b", gpus=128, seq_len=8192, global_batch_tokens=128 * 8192), H100)
    assert 40 * 2**30 < row.memory_bytes < 90 * 2**30


def test_a_search_that_cannot_be_laid_out_or_is_asked_wrongly_says_so_in_one_line():
    with pytest.raises(LabUsageError, match="global_batch_tokens"):
        scale.search(TINY, gpus=8, seq_len=32, global_batch_tokens=33)
    for bad in ({"gpus": 0}, {"gpus": 8, "checks": 0}, {"gpus": 8, "top": 1.5}):
        with pytest.raises(LabUsageError) as caught:
            scale.search(TINY, **bad)
        assert "\n" not in str(caught.value)
    with pytest.raises(LabUsageError, match="unknown model"):
        scale.search("llama3-7b", gpus=8)


@pytest.mark.cluster
def test_the_plans_found_are_the_fastest_dry_runs_that_fit_screened_and_checked_in_the_order_estimated():
    laid = layouts(TINY, 8, H100, 32, 32 * 8 * 4)
    # a GPU whose memory is the median estimate: about half the layouts are screened out
    guesses = sorted(estimate(p, H100).memory_bytes for p in laid)
    small = dataclasses.replace(H100, memory_bytes=guesses[len(guesses) // 2])
    found = scale.search(TINY, gpus=8, hardware=small, seq_len=32, global_batch_tokens=32 * 8 * 4, top=2, checks=3)
    over = [p for p in laid if estimate(p, small).memory_bytes > SLACK * small.memory_bytes]
    assert found.laid_out == len(laid) and found.screened_out == len(over) > 0
    assert 1 <= len(found.checked) <= 3
    times = [c.estimate.step_time_s for c in found.checked]
    assert times == sorted(times)  # dry-run fastest estimate first
    for c in found.checked:
        assert c.plan not in over
        assert c.fits == (c.prediction.memory_per_gpu_bytes <= small.memory_bytes)
        assert c.prediction.memory_per_gpu_bytes == max(k.memory["peak"] for k in c.report.kinds)
    fitting = [c for c in found.checked if c.fits]
    assert found.plans == sorted(fitting, key=lambda c: -c.prediction.tokens_per_s_per_gpu)
    assert len(fitting) <= 2  # stopped at top=
    assert found.laid_out >= found.screened_out + found.corrected_out + len(found.checked)
    text = str(found)
    assert f"{len(laid)} layouts" in text and text.count("\n") == len(found.checked)
    if found.plans:
        assert found.best is found.plans[0]
