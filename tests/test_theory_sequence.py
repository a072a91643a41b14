"""distlab.theory for the sequence split over ranks (ring attention's causal work) and for experts' capacity."""

from __future__ import annotations

import pytest

from distlab import theory


def test_contiguous_chunks_give_the_last_rank_n_times_the_first_ranks_work():
    pairs = theory.ring_attention_pairs(2048, 4)
    assert pairs == [(r + 1) * 512 * 512 for r in range(4)]
    assert theory.causal_load_imbalance(4) == pytest.approx(2 * 4 / 5)
    assert theory.causal_load_imbalance(64) == pytest.approx(128 / 65)  # towards 2


def test_zigzag_chunks_even_the_work_out_and_skip_more_of_the_masked_half():
    pairs = theory.ring_attention_pairs(2048, 4, "zigzag")
    assert pairs == [9 * 256 * 256] * 4 and theory.causal_load_imbalance(4, "zigzag") == 1.0
    # Smaller chunks skip more of the future: less work in all than four whole diagonal blocks.
    assert sum(pairs) < sum(theory.ring_attention_pairs(2048, 4))
    assert sum(pairs) > 2048 * 2049 // 2  # but never less than the causal half itself


def test_an_expert_has_capacity_factor_times_its_even_share_of_slots():
    assert theory.expert_capacity(256, 4) == 64
    assert theory.expert_capacity(256, 4, 1.25) == 80
    assert theory.expert_capacity(10, 4, 1.0) == 2  # floor: 2.5 slots is 2


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: theory.ring_attention_pairs(1000, 3), "must split into 3 equal chunks"),
        (lambda: theory.ring_attention_pairs(1024, 4, "striped"), "unknown layout 'striped'"),
        (lambda: theory.expert_capacity(256, 0), "experts must be >= 1"),
        (lambda: theory.expert_capacity(256, 4, 0), "capacity_factor must be a number > 0"),
    ],
)
def test_bad_arguments_say_what_is_wrong(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_averaging_every_h_steps_sends_one_hth_of_ddps_bytes():
    psi = 400e6
    assert theory.local_sgd_bytes_per_step(psi, 8, 1) == pytest.approx(theory.ddp_bytes_per_step(psi, 8))
    assert theory.local_sgd_bytes_per_step(psi, 8, 500) == pytest.approx(2 * 7 / 8 * psi / 500)
    # The step it buys on a slow link: the compute whole, the all-reduce once per H steps.
    assert theory.averaged_step_time_s(0.003, 0.010, 1) == pytest.approx(0.013)
    assert theory.averaged_step_time_s(0.003, 0.010, 25) == pytest.approx(0.0034)
    with pytest.raises(ValueError, match="interval"):
        theory.averaged_step_time_s(0.003, 0.010, 0)
    with pytest.raises(ValueError, match="allreduce_s"):
        theory.averaged_step_time_s(0.003, -1.0, 4)
    with pytest.raises(ValueError, match="interval must be >= 1"):
        theory.local_sgd_bytes_per_step(psi, 8, 0)


def test_gathering_the_logits_moves_the_vocabulary_and_loss_parallel_three_values_a_token():
    tokens, vocab = 4 * 64, 32768
    # All-gather of the whole logits: each of 2 ranks receives the other's half.
    assert theory.received_logits_bytes(tokens, vocab, 2) == pytest.approx(tokens * vocab * 4 / 2)
    # Loss parallel: 3 all-reduces of one float a token, 2(N-1)/N of each.
    assert theory.received_logits_bytes(tokens, vocab, 2, loss_parallel=True) == pytest.approx(3 * tokens * 4)
    assert theory.received_logits_bytes(8192, 128_256, 8, 2) == pytest.approx(7 / 8 * 8192 * 128_256 * 2)
    assert theory.received_logits_bytes(tokens, vocab, 1) == 0.0
    with pytest.raises(ValueError, match="vocab_size"):
        theory.received_logits_bytes(tokens, 0, 2)
