"""distlab.theory's models of modern parallelism against the numbers their papers publish, against
simulations of the algorithms they model, and against torch's own schedules and modules."""

from __future__ import annotations

import pytest

from distlab import theory

GB = 1e9

# --- collectives ----------------------------------------------------------------------------------


def _ring_allreduce(values: list[list[float]]) -> tuple[list[list[float]], list[int], list[int]]:
    """A ring all-reduce run element by element: reduce-scatter, then all-gather, N-1 steps each.
    Returns every rank's result and the elements each rank sent and received."""
    n, size = len(values), len(values[0])
    bounds = [size * i // n for i in range(n + 1)]
    chunk = [list(range(bounds[i], bounds[i + 1])) for i in range(n)]
    data = [list(v) for v in values]
    sent, received = [0] * n, [0] * n
    for phase in ("reduce", "gather"):
        for step in range(n - 1):
            # Rank r sends chunk (r - step) (reduce) or (r + 1 - step) (gather) to rank r+1, all at once.
            outgoing = []
            for r in range(n):
                c = (r - step) % n if phase == "reduce" else (r + 1 - step) % n
                outgoing.append((r, c, [data[r][i] for i in chunk[c]]))
            for r, c, payload in outgoing:
                dest = (r + 1) % n
                for i, value in zip(chunk[c], payload):
                    data[dest][i] = data[dest][i] + value if phase == "reduce" else value
                sent[r] += len(payload)
                received[dest] += len(payload)
    return data, sent, received


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_a_simulated_ring_all_reduce_sends_what_collective_bytes_says(ranks):
    size = 24  # elements, divisible by every N here
    values = [[float(r * 100 + i) for i in range(size)] for r in range(ranks)]
    result, sent, received = _ring_allreduce(values)
    total = [sum(v[i] for v in values) for i in range(size)]
    assert all(row == total for row in result)  # the simulation is a real all-reduce
    expected = theory.collective_bytes("all_reduce", size, ranks)
    assert sent == [pytest.approx(expected.sent_bytes)] * ranks
    assert received == [pytest.approx(expected.received_bytes)] * ranks
    # all-reduce = reduce-scatter + all-gather, each half the traffic
    half = theory.collective_bytes("reduce_scatter", size, ranks).sent_bytes
    assert half + theory.collective_bytes("all_gather", size, ranks).sent_bytes == pytest.approx(sent[0])


def test_ring_phases_send_n_minus_1_over_n_and_all_reduce_twice_that():
    s, n = 1e9, 8
    for op in ("reduce_scatter", "all_gather", "all_to_all"):
        moved = theory.collective_bytes(op, s, n)
        assert (moved.sent_bytes, moved.received_bytes) == (pytest.approx(7 / 8 * s), pytest.approx(7 / 8 * s))
    assert theory.collective_bytes("all_reduce", s, n).sent_bytes == pytest.approx(2 * 7 / 8 * s)
    sent = theory.collective_bytes("all_reduce", s, n).sent_bytes
    assert sent == pytest.approx(theory.ring_allreduce_sent_bytes(s, n))
    assert theory.collective_bytes("all_gather", s, 1) == theory.CollectiveBytes(0.0, 0.0)


def test_a_chain_broadcast_moves_the_tensor_once_per_hop_from_any_root():
    s, n = 4e6, 5
    for root in range(n):
        moved = [theory.collective_bytes("broadcast", s, n, rank=r, root=root) for r in range(n)]
        assert moved[root] == theory.CollectiveBytes(s, 0.0)
        last = (root - 1) % n
        assert moved[last] == theory.CollectiveBytes(0.0, s)
        assert sum(m.sent_bytes for m in moved) == sum(m.received_bytes for m in moved) == (n - 1) * s


def test_bus_bandwidth_factors_are_nccl_tests():
    # nccl-tests, doc/PERFORMANCE.md: allreduce 2(n-1)/n; reducescatter, allgather, alltoall (n-1)/n; broadcast 1.
    n = 16
    assert theory.bus_bandwidth_factor("all_reduce", n) == pytest.approx(2 * 15 / 16)
    for op in ("reduce_scatter", "all_gather", "all_to_all"):
        assert theory.bus_bandwidth_factor(op, n) == pytest.approx(15 / 16)
    assert theory.bus_bandwidth_factor("broadcast", n) == 1
    algbw = theory.algbw_bytes_per_s(1e9, 0.1)
    assert theory.busbw_bytes_per_s(1e9, 0.1, 16, op="all_gather") == pytest.approx(algbw * 15 / 16)
    assert theory.busbw_bytes_per_s(1e9, 0.1, 16) == pytest.approx(algbw * 2 * 15 / 16)  # all-reduce by default


def test_collective_time_is_steps_times_latency_plus_bytes_over_bandwidth():
    s, n, bw, a = 400e6, 4, 25e9, 5e-6
    # The ring model of the curriculum: the latency counted per step, 2(N-1) = 6 of them here.
    all_reduce = theory.collective_time_s("all_reduce", s, n, bw, a)
    assert all_reduce == pytest.approx(1.5 * s / bw + 6 * a)
    assert all_reduce == pytest.approx(theory.ring_allreduce_time_s(s, n, bw, a))
    rs = theory.collective_time_s("reduce_scatter", s, n, bw, a)
    ag = theory.collective_time_s("all_gather", s, n, bw, a)
    assert rs + ag == pytest.approx(theory.collective_time_s("all_reduce", s, n, bw, a))
    assert theory.collective_time_s("broadcast", s, n, bw, a) == pytest.approx(s / bw + 3 * a)
    assert theory.collective_time_s("broadcast", s, 1, bw, a) == 0


# --- transformers ---------------------------------------------------------------------------------


GPT2_SMALL = theory.TransformerShape(layers=12, hidden=768, heads=12, seq_len=1024, vocab=50257)


def test_gpt2_small_has_its_124m_parameters_and_nanogpts_count_without_positions():
    # Hugging Face's GPT-2 small has 124,439,808 parameters; nanoGPT reports 123.65M, without the
    # 1,024 x 768 position embedding (its get_num_params).
    assert GPT2_SMALL.parameters() == 124_439_808
    assert GPT2_SMALL.parameters() - 1024 * 768 == 123_653_376
    assert GPT2_SMALL.non_embedding_parameters() == 12 * (12 * 768**2 + 13 * 768) + 2 * 768


def _torch_gpt2(shape):
    from torch import nn

    h, a, f = shape.hidden, shape.attention_width, shape.ffn_hidden

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.c_attn, self.attn_proj = nn.Linear(h, 3 * a), nn.Linear(a, h)
            self.c_fc, self.mlp_proj = nn.Linear(h, f), nn.Linear(f, h)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(shape.vocab, h)
            self.wpe = nn.Embedding(shape.seq_len, h) if shape.learned_positions else None
            self.h = nn.ModuleList(Block() for _ in range(shape.layers))
            self.ln_f = nn.LayerNorm(h)
            self.lm_head = nn.Linear(h, shape.vocab, bias=False)
            if shape.tied_embeddings:
                self.lm_head.weight = self.wte.weight  # parameters() yields a shared tensor once

    return GPT()


@pytest.mark.parametrize(
    "shape",
    [
        theory.TransformerShape(layers=2, hidden=64, heads=4, seq_len=32, vocab=101),
        theory.TransformerShape(layers=3, hidden=48, heads=3, seq_len=16, vocab=57, tied_embeddings=False),
        theory.TransformerShape(
            layers=1, hidden=32, heads=2, seq_len=8, vocab=50, ffn_hidden=80, learned_positions=False
        ),
        theory.TransformerShape(layers=2, hidden=40, heads=4, seq_len=8, vocab=30, head_dim=6),
    ],
)
def test_parameters_equal_a_torch_gpt2_layout_numel(shape):
    model = _torch_gpt2(shape)
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.h.parameters()) + sum(p.numel() for p in model.ln_f.parameters())
    assert shape.non_embedding_parameters() == blocks


def test_palm_540b_flops_per_token_and_its_46_2_percent_mfu():
    # Chowdhery et al. 2022 (PaLM): N = 540.35B, 118 layers, 48 heads of 256 (attention width 12,288,
    # d_model 18,432), T = 2048; appendix B: model FLOPs per token 6N + 12LHQT; 238.3K tokens/s on
    # 6144 TPU v4 chips of 275 peak TFLOP/s give 46.2% MFU (Table 3).
    palm = theory.TransformerShape(layers=118, hidden=18432, heads=48, seq_len=2048, vocab=256_000, head_dim=256)
    six_n = theory.training_flops_per_token(palm, attention=False, parameters=540.35e9)
    assert round(six_n / 1e12, 2) == 3.24
    flops = theory.training_flops_per_token(palm, parameters=540.35e9)
    assert flops - six_n == 12 * 118 * 48 * 256 * 2048
    mfu = theory.model_flops_utilization(238.3e3, flops, 6144 * 275e12)
    assert round(mfu, 3) == 0.462
    # With d_model in place of heads x head size the attention term is 1.5x too large: 46.5%, not the paper's.
    wide = theory.TransformerShape(layers=118, hidden=18432, heads=48, seq_len=2048, vocab=256_000)
    assert round(theory.model_flops_utilization(238.3e3, theory.training_flops_per_token(wide, parameters=540.35e9),
                                                6144 * 275e12), 3) == 0.465


def test_default_n_counts_the_tied_output_layer_but_not_the_position_lookup():
    n = GPT2_SMALL.parameters() - 1024 * 768
    assert theory.training_flops_per_token(GPT2_SMALL, attention=False) == 6 * n
    assert theory.training_flops_per_token(GPT2_SMALL) == 6 * n + 12 * 12 * 768 * 1024


# GPT-3 175B as Korthikanti et al. 2022 train it: s = 2048, h = 12288, a = 96, t = 8, b = 1.
GPT3 = {"seq_len": 2048, "micro_batch": 1, "hidden": 12288, "heads": 96}


def test_korthikanti_table_2_formulas_for_gpt3():
    sbh = 2048 * 12288
    as_h = 5 * 96 * 2048 / 12288  # 80: the attention scores outweigh the 34 of everything else
    assert theory.activation_bytes_per_layer(**GPT3) == pytest.approx(sbh * (34 + as_h))
    assert theory.activation_bytes_per_layer(**GPT3, tensor_parallel=8) == pytest.approx(sbh * (10 + 24 / 8 + as_h / 8))
    sp = theory.activation_bytes_per_layer(**GPT3, tensor_parallel=8, sequence_parallel=True)
    assert sp == pytest.approx(sbh * (34 + as_h) / 8)
    assert theory.activation_bytes_per_layer(**GPT3, tensor_parallel=8, recompute="selective") == pytest.approx(
        sbh * (10 + 24 / 8)
    )
    assert theory.activation_bytes_per_layer(**GPT3, recompute="full") == 2 * sbh


def test_sequence_parallel_with_selective_recompute_cuts_activations_about_5x():
    # The paper's abstract: together they reduce activation memory by 5x (against tensor parallelism alone).
    tp = theory.activation_bytes_per_layer(**GPT3, tensor_parallel=8)
    both = theory.activation_bytes_per_layer(**GPT3, tensor_parallel=8, sequence_parallel=True, recompute="selective")
    assert round(tp / both) == 5


@pytest.mark.parametrize(("heads", "hidden", "saved"), [(96, 12288, 0.70), (128, 20480, 0.65)])
def test_selective_recompute_saves_70_percent_for_gpt3_and_65_for_mt_nlg(heads, hidden, saved):
    # Korthikanti et al. 2022, section 5: 70% less activation memory for GPT-3, 65% for MT-NLG (530B).
    shape = {"seq_len": 2048, "micro_batch": 1, "hidden": hidden, "heads": heads}
    selective = theory.activation_bytes_per_layer(**shape, recompute="selective")
    kept = selective / theory.activation_bytes_per_layer(**shape)
    assert round(1 - kept, 2) == saved


def test_wider_activations_grow_but_the_one_byte_masks_do_not():
    two = theory.activation_bytes_per_layer(**GPT3, recompute="selective")
    four = theory.activation_bytes_per_layer(**GPT3, recompute="selective", bytes_per_element=4)
    assert four == pytest.approx(2 * two - 2 * 2048 * 12288)  # 32 of the 34 double; the masks' 2 stay


# --- sharding -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "gigabytes"), [("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9), ("fsdp2", 1.9)]
)
def test_zero_figure_1_per_device_memory(strategy, gigabytes):
    # Rajbhandari et al. 2020 (ZeRO), Figure 1: Psi = 7.5B, N_d = 64, K = 12 (mixed-precision Adam):
    # baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB.
    memory = theory.sharded_memory(7.5e9, strategy, data_parallel=64)
    assert round(memory.total_bytes / GB, 1) == gigabytes
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}[strategy]
    assert memory.total_bytes == pytest.approx(theory.memory_per_device_bytes(7.5e9, devices=64, zero_stage=stage))


def test_tensor_and_pipeline_parallelism_divide_the_model_before_data_parallelism_shards_it():
    alone = theory.sharded_memory(8e9, "zero1", data_parallel=4)
    split = theory.sharded_memory(8e9 * 8, "zero1", data_parallel=4, tensor_parallel=4, pipeline_parallel=2)
    assert split == alone


def test_fsdp2_peak_adds_the_gathered_units_and_more_without_resharding():
    p = 1e9
    one_unit = theory.sharded_memory(p, "fsdp2", 8)
    assert one_unit.peak_extra_bytes == pytest.approx(2 * p)  # the whole model gathered in 16 bits
    wrapped = theory.sharded_memory(p, "fsdp2", 8, largest_unit_parameters=p / 24)
    assert wrapped.peak_extra_bytes == pytest.approx(2 * 2 * p / 24)  # computing + prefetched unit
    kept = theory.sharded_memory(p, "fsdp2", 8, reshard_after_forward=False, largest_unit_parameters=p / 24)
    assert kept.peak_extra_bytes == pytest.approx(2 * p)  # every unit whole from forward to backward
    assert kept.total_bytes == wrapped.total_bytes  # what stays between steps is the same
    assert theory.sharded_memory(p, "zero2", 8).peak_extra_bytes == 0
    fp32 = theory.sharded_memory(p, "zero3", 8, precision="fp32", largest_unit_parameters=p / 24)
    assert fp32.peak_extra_bytes == pytest.approx(4 * 2 * p / 24)


def test_cpu_offload_moves_every_sharded_state_to_the_host():
    on_device = theory.sharded_memory(1e9, "fsdp2", 8, largest_unit_parameters=1e8)
    offloaded = theory.sharded_memory(1e9, "fsdp2", 8, largest_unit_parameters=1e8, cpu_offload=True)
    assert offloaded.total_bytes == 0
    assert offloaded.offloaded_bytes == on_device.total_bytes
    assert offloaded.peak_extra_bytes == on_device.peak_extra_bytes


def test_fsdp_moves_one_and_a_half_times_ddp_and_as_much_without_resharding():
    psi, n = 2e9, 8
    ddp = theory.ddp_bytes_per_step(psi, n)
    assert ddp == pytest.approx(2 * 7 / 8 * psi)
    assert theory.fsdp_bytes_per_step(psi, n) == pytest.approx(3 * 7 / 8 * psi)
    assert theory.fsdp_bytes_per_step(psi, n) == pytest.approx(1.5 * ddp)
    assert theory.fsdp_bytes_per_step(psi, n, reshard_after_forward=False) == pytest.approx(ddp)


def test_tensor_parallel_moves_four_activation_all_reduces_per_layer_with_or_without_sp():
    b, s, h, layers, t = 4, 2048, 4096, 32, 8
    activation = b * s * h * 2
    expected = layers * 4 * 2 * (t - 1) / t * activation
    assert theory.tensor_parallel_bytes_per_step(b, s, h, layers, t) == pytest.approx(expected)
    assert theory.tensor_parallel_bytes_per_step(b, s, h, layers, t, sequence_parallel=True) == pytest.approx(expected)
    assert theory.tensor_parallel_bytes_per_step(b, s, h, layers, 1) == 0


def test_a_stage_boundary_carries_activations_forward_and_gradients_back():
    assert theory.pipeline_bytes_per_step(2, 1024, 1024, micro_batches=8) == 2 * 8 * 2 * 1024 * 1024 * 2


# --- pipelines ------------------------------------------------------------------------------------


def test_gpipe_and_1f1b_bubbles_and_interleaving_shrinks_it_v_times():
    # p = 4, m = 8: (p-1)/(m+p-1) = 3/11 (Huang et al. 2019; Narayanan et al. 2021).
    for schedule in ("gpipe", "1f1b"):
        assert theory.bubble_fraction(4, 8, schedule) == pytest.approx(3 / 11)
        assert theory.bubble_ratio(4, 8, schedule) == pytest.approx(3 / 8)
    assert theory.bubble_fraction(4, 8, "interleaved", chunks=2) == pytest.approx(3 / 19)
    assert theory.bubble_ratio(4, 8, "interleaved", chunks=2) == pytest.approx(3 / 16)
    assert theory.pipeline_bubble_fraction(4, 8) == theory.bubble_fraction(4, 8, "gpipe")


@pytest.mark.parametrize(
    ("schedule", "chunks", "shapes"),
    [
        ("gpipe", 1, [(2, 4), (4, 8), (4, 3), (8, 16)]),
        ("1f1b", 1, [(2, 4), (4, 8), (4, 4), (8, 16)]),
        ("interleaved", 2, [(2, 4), (4, 8), (4, 6), (8, 16), (3, 4)]),
        ("interleaved", 3, [(4, 8), (4, 12)]),
    ],
)
def test_torchs_order_run_on_uniform_stages_takes_the_modelled_time_and_holds_the_modelled_activations(
    schedule, chunks, shapes
):
    forward_s, backward_s = 1.0, 2.0
    for stages, micro_batches in shapes:
        timeline = theory.pipeline_timeline(stages, micro_batches, forward_s, backward_s, schedule, chunks)
        end = max(stop for stage in timeline for _, _, stop in stage)
        modelled = theory.pipeline_step_time_s(stages, micro_batches, forward_s, backward_s, schedule, chunks)
        assert end == pytest.approx(modelled)
        busy = sum(stop - start for stage in timeline for _, start, stop in stage)
        idle = 1 - busy / (stages * end)
        assert idle == pytest.approx(theory.bubble_fraction(stages, micro_batches, schedule, chunks))
        for stage, actions in enumerate(timeline):
            held = most = 0
            for action, _, _ in actions:
                held += 1 if "F" in action else -1
                most = max(most, held)
            assert most / chunks == theory.in_flight_micro_batches(stage, stages, micro_batches, schedule, chunks)


def test_interleaving_fewer_micro_batches_than_stages_idles_longer_than_the_papers_bubble():
    # torch runs it (one round of m < p); the device waits between its chunks, so the formula is refused.
    timeline = theory.pipeline_timeline(4, 3, 1.0, 2.0, "interleaved", chunks=2)
    end = max(stop for stage in timeline for _, _, stop in stage)
    assert end > (3 + 3 / 2) * 3.0
    with pytest.raises(ValueError, match=r"holds for micro_batches >= stages \(4\), got 3"):
        theory.pipeline_step_time_s(4, 3, 1.0, 2.0, "interleaved", chunks=2)
    for stage, actions in enumerate(timeline):
        held = [sum(1 if "F" in a else -1 for a, _, _ in actions[: i + 1]) for i in range(len(actions))]
        assert max(held) / 2 == theory.in_flight_micro_batches(stage, 4, 3, "interleaved", chunks=2)


def test_1f1b_holds_p_minus_stage_micro_batches_where_gpipe_holds_all():
    assert [theory.in_flight_micro_batches(s, 4, 8, "1f1b") for s in range(4)] == [4, 3, 2, 1]
    assert [theory.in_flight_micro_batches(s, 4, 8, "gpipe") for s in range(4)] == [8] * 4
    assert theory.pipeline_schedule(2, 3, "1f1b") == [
        ["F0", "F1", "B0", "F2", "B1", "B2"],
        ["F0", "B0", "F1", "B1", "F2", "B2"],
    ]


def _torch_order(schedule_class, method, stages, micro_batches, chunks=1):
    """torch's own per-rank compute order, from the schedule's order builder (no process group needed)."""
    schedule = object.__new__(schedule_class)
    schedule._num_stages, schedule._n_microbatches = stages * chunks, micro_batches
    schedule.pp_group_size, schedule.n_local_stages = stages, chunks
    schedule.microbatches_per_round = micro_batches // max(1, micro_batches // stages)
    if method == "_get_pipeline_order":
        orders = [schedule._get_pipeline_order()[rank] for rank in range(stages)]
    else:
        orders = [schedule._calculate_single_rank_operations(rank) for rank in range(stages)]
    kinds = {"F", "B"}
    named = []
    for order in orders:
        actions = [a for a in order if a is not None and a.computation_type.value in kinds]
        if chunks == 1:
            named.append([f"{a.computation_type.value}{a.microbatch_index}" for a in actions])
        else:
            named.append([str(a) for a in actions])
    return named


@pytest.mark.parametrize(
    ("schedule", "class_name", "method", "chunks"),
    [
        ("gpipe", "ScheduleGPipe", "_get_pipeline_order", 1),
        ("1f1b", "Schedule1F1B", "_get_pipeline_order", 1),
        ("interleaved", "ScheduleInterleaved1F1B", "_calculate_single_rank_operations", 2),
    ],
)
def test_pipeline_schedule_is_the_order_torch_distributed_pipelining_builds(schedule, class_name, method, chunks):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    schedule_class = getattr(schedules, class_name)
    if not hasattr(schedule_class, method):
        pytest.skip(f"this torch's {class_name} has no {method} to compare with")
    for stages, micro_batches in [(2, 4), (4, 8), (4, 12), (3, 6)]:
        ours = theory.pipeline_schedule(stages, micro_batches, schedule, chunks)
        torchs = _torch_order(schedule_class, method, stages, micro_batches, chunks)
        if schedule == "1f1b":
            # Schedule1F1B._get_pipeline_order names the last stage's forwards F1..Fm (its counter starts
            # at 0 and is incremented before use when there is no warm-up); _step_microbatches, which is
            # what runs, does F0, B0, F1, ... there. Compare the other stages, and the last with what runs.
            assert ours[-1] == [f"{kind}{i}" for i in range(micro_batches) for kind in "FB"]
            ours, torchs = ours[:-1], torchs[:-1]
        assert ours == torchs


# --- names and argument checks --------------------------------------------------------------------


def test_new_names_carry_their_dimension_for_the_quizzes():
    assert theory.dimension_of("collective_time_s") == "time"
    assert theory.dimension_of("fsdp_bytes_per_step") == "bytes"
    assert theory.dimension_of("tokens_per_s") == "number"
    assert theory.dimension_of("peak_flops_per_s") == "number"
    assert theory.dimension_of("bandwidth_bytes_per_s") == "bandwidth"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: theory.collective_bytes("allreduce", 1e6, 4), "unknown op 'allreduce': choose one of all_reduce"),
        (lambda: theory.collective_bytes("broadcast", 1e6, 4, root=4), r"root must be below world_size \(4\)"),
        (lambda: theory.collective_time_s("all_gather", 1e6, 4, 0), "bandwidth_bytes_per_s must be a number > 0"),
        (lambda: theory.bubble_fraction(4, 8, "1f1b", chunks=2), "chunks=2 applies to schedule='interleaved' only"),
        (lambda: theory.bubble_fraction(4, 8, "zb"), "unknown schedule 'zb': choose one of gpipe, 1f1b"),
        (lambda: theory.pipeline_schedule(4, 2, "1f1b"), r"Schedule1F1B needs micro_batches >= stages \(4\)"),
        (lambda: theory.pipeline_schedule(2, 7, "interleaved"), "a multiple of its 3 rounds"),
        (lambda: theory.in_flight_micro_batches(4, 4, 8), r"stage must be below stages \(4\)"),
        (lambda: theory.sharded_memory(1e9, "fsdp", 8), "unknown strategy 'fsdp': choose one of ddp, zero1"),
        (lambda: theory.sharded_memory(1e9, "zero2", 8, cpu_offload=True), "cpu_offload applies to zero3 and fsdp2"),
        (lambda: theory.activation_bytes_per_layer(2048, 1, 12288, 96, recompute="some"), "unknown recompute 'some'"),
        (lambda: theory.TransformerShape(2, 100, 3, 16, 50), r"hidden \(100\) is not a multiple of heads \(3\)"),
        (lambda: theory.tensor_parallel_bytes_per_step(1, 0, 64, 2, 2), "seq_len must be >= 1"),
        (lambda: theory.training_flops_per_token(124e6), "shape must be a TransformerShape"),
    ],
)
def test_bad_arguments_raise_one_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("rows, world_size", [(128256, 1024), (7, 3), (5, 4), (2, 3), (0, 2), (12, 4), (1, 1)])
def test_fsdp2s_shard_rows_are_torch_chunks_split_and_every_rank_allocates_a_full_chunk(rows, world_size):
    import torch

    chunks = [len(c) for c in torch.arange(rows).chunk(world_size)] if rows else []
    chunks += [0] * (world_size - len(chunks))  # torch.chunk may give fewer chunks than ranks: those hold none
    assert [theory.fsdp_shard_rows(rows, world_size, r) for r in range(world_size)] == chunks
    assert theory.fsdp_padded_shard_bytes(rows, 3, world_size) == max(chunks) * 3 * 4
    with pytest.raises(ValueError, match="rank must be below world_size"):
        theory.fsdp_shard_rows(rows, world_size, world_size)
