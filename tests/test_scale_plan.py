"""scale.Plan's checks (one line for a plan that cannot exist) and the models' parameter counts
against their published sizes. Fast tier: no torch, no process."""

from __future__ import annotations

import pytest

from distlab import scale
from distlab.errors import LabUsageError

BASE = {"model": "llama3-8b", "gpus": 1024, "tp": 8, "seq_len": 8192, "global_batch_tokens": 4 * 2**20}


def test_a_plan_derives_its_data_parallel_degree_micro_batches_and_tokens():
    plan = scale.Plan(**BASE)
    assert (plan.dp_degree, plan.micro_batches, plan.tokens_per_step) == (128, 4, 4 * 2**20)
    assert plan.dims == {"pp": 1, "dp_replicate": 1, "dp_shard": 128, "cp": 1, "tp": 8}
    hsdp = scale.Plan(**{**BASE, "dp": "hsdp", "shard": 8})
    assert hsdp.dims["dp_replicate"] == 16 and hsdp.dims["dp_shard"] == 8
    piped = scale.Plan(**{**BASE, "model": "llama3-70b", "pp": 4, "global_batch_tokens": 2**22})
    assert piped.dp_degree == 32 and piped.micro_batches == 16
    assert scale.Plan(**BASE) == scale.Plan(**BASE)  # the predictor compares a report's plan with its own


@pytest.mark.parametrize(
    "change, says",
    [
        ({"gpus": 1020}, "tp*pp*cp = 8 must divide it"),
        ({"gpus": 768, "tp": 3}, "tp=3 does not divide llama3-8b's 32 heads"),
        ({"gpus": 1024, "tp": 16}, "tp=16 does not divide llama3-8b's 8 kv_heads"),
        ({"model": "llama3-8", "tp": 8}, "unknown model 'llama3-8': did you mean 'llama3-8b'"),
        ({"model": "gpt-175b"}, "did you mean 'gpt3-175b'"),
        ({"pp": 64, "tp": 1, "gpus": 64 * 16}, "64 stages are more than llama3-8b's 32 layers"),
        ({"pp": 4, "stage_layers": (8, 8, 8)}, "stage_layers=(8, 8, 8) must give each of the pp*chunks = 4 stages"),
        ({"pp": 4, "stage_layers": (9, 8, 8, 8)}, "32 in all (llama3-8b); e.g. stage_layers=(8, 8, 8, 8)"),
        ({"pp": 4, "stage_layers": (16, 16, 0, 0)}, "at least 1 per stage"),
        ({"global_batch_tokens": 4_000_000}, "not a whole number of micro-batches"),
        ({"global_batch_tokens": 8192 * 64}, "is not a whole number of micro-batches"),
        ({"dp": "hsdp"}, "dp='hsdp' needs shard="),
        ({"dp": "hsdp", "shard": 3}, "shard=3 does not divide the 128 data-parallel ranks"),
        ({"shard": 8}, "shard= is for dp='hsdp'"),
        ({"pp": 4, "global_batch_tokens": 8192 * 32 * 2}, "2 micro-batches cannot fill 4 pipeline stages"),
        ({"chunks": 2}, "chunks=2 is for schedule='interleaved'"),
        ({"dp": "zero"}, "unknown dp 'zero'"),
        ({"seq_len": 2**18, "global_batch_tokens": 2**18 * 128}, "longer than llama3-8b's 131072 positions"),
        ({"model": "gpt3-175b", "sequence_parallel": True, "seq_len": 2048, "global_batch_tokens": 2048 * 128},
         "sequence_parallel=True is dry-run for Llama models"),
        ({"seq_len": 8196, "global_batch_tokens": 8196 * 128}, "seq_len=8196 does not split over tp=8"),
        ({"sequence_parallel": "yes"}, "sequence_parallel"),
    ],
)
def test_a_plan_that_cannot_exist_is_one_line_saying_why_and_what_to_change(change, says):
    with pytest.raises(LabUsageError) as caught:
        scale.Plan(**{**BASE, **change})
    message = str(caught.value)
    assert says in message and "\n" not in message, message


def test_sequence_parallelism_is_torchtitans_choice_unless_asked():
    assert scale.Plan(**BASE).sequence_parallel_on  # llama3-8b at tp 8
    assert not scale.Plan(**{**BASE, "sequence_parallel": False}).sequence_parallel_on
    assert not scale.Plan(**{**BASE, "tp": 1, "global_batch_tokens": 8 * 2**20}).sequence_parallel_on
    gpt = scale.Plan(**{**BASE, "model": "gpt3-175b", "seq_len": 2048, "global_batch_tokens": 2048 * 128})
    assert not gpt.sequence_parallel_on and gpt.to_json()["sequence_parallel"] is False


def test_a_model_can_be_given_by_its_config():
    mine = scale.ModelConfig("tiny", "llama", 256, 4, 8, 2, 512, 1000, 1024)
    plan = scale.Plan(model=mine, gpus=8, tp=2, seq_len=128, global_batch_tokens=128 * 4)
    assert plan.config is mine and plan.to_json()["model"]["dim"] == 256


@pytest.mark.parametrize(
    "name, published",
    [
        ("llama3-8b", 8.03e9),  # Llama 3 paper / model card: 8.03B
        ("llama3-70b", 70.6e9),  # 70.6B
        ("llama3-405b", 405.9e9),  # 405.9B (~405B)
        ("gpt3-175b", 175.0e9),  # Brown et al. 2020: 175.0B
        ("megatron-145.6b", 145.6e9),  # Narayanan et al. 2021 table 1
        ("megatron-1t", 1008.0e9),
    ],
)
def test_parameter_counts_match_the_published_sizes(name, published):
    assert scale.parameters(scale.MODELS[name]) == pytest.approx(published, rel=0.005)


def test_llama3_8b_has_exactly_its_published_parameter_count():
    assert scale.parameters(scale.MODELS["llama3-8b"]) == 8_030_261_248


def test_a_pipeline_splits_the_layers_evenly_where_it_can_else_as_torchtitan_and_the_llama_3_paper_do():
    assert scale.Plan(**{**BASE, "pp": 4}).layers_per_stage == (8,) * 4
    big = {**BASE, "model": "llama3-405b", "gpus": 8192, "global_batch_tokens": 2048 * 8192}
    # 126 layers over 16 stages: one fewer on the first and the last (Llama 3 paper, section 3.3.2).
    assert scale.Plan(**{**big, "pp": 16}).layers_per_stage == (7,) + (8,) * 14 + (7,)
    assert scale.Plan(**{**big, "pp": 8}).layers_per_stage == (15,) + (16,) * 6 + (15,)
    interleaved = scale.Plan(**{**big, "pp": 16, "schedule": "interleaved", "chunks": 2})
    assert interleaved.layers_per_stage == (3,) + (4,) * 30 + (3,)
    given = scale.Plan(**{**big, "pp": 8, "stage_layers": (14, 16, 16, 16, 16, 16, 16, 16)})
    assert given.layers_per_stage == (14, 16, 16, 16, 16, 16, 16, 16)
    assert given.to_json()["stage_layers"] == [14, 16, 16, 16, 16, 16, 16, 16]
    assert sum(interleaved.layers_per_stage) == 126
