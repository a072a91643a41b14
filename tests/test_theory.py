"""distlab.theory: the curriculum's worked numbers, edge cases, and clear errors for bad input."""

from __future__ import annotations

import math
import random

import pytest

from distlab import theory

# --- the curriculum's worked numbers (topics mapped in notebooks/README.md) ---------------------------


def test_global_batch_of_the_curriculum_is_256():
    assert theory.global_batch_size(per_device_batch=8, devices=16, accumulation_steps=2) == 256


def test_ring_allreduce_of_the_curriculum_takes_about_24_ms():
    # N=4, S=400 MB, B=25 GB/s, a=5 us: 1.5 * 16 ms + 2(N-1) = 6 steps of 5 us, 30 us.
    time_s = theory.ring_allreduce_time_s(size_bytes=400e6, workers=4, bandwidth_bytes_per_s=25e9, latency_s=5e-6)
    assert time_s == pytest.approx(24.030e-3, rel=1e-12)
    assert round(time_s * 1e3, 1) == 24.0


def test_two_billion_parameters_of_mixed_adam_take_32_gb():
    assert theory.bytes_per_parameter("mixed", "adam") == 16
    assert theory.memory_per_device_bytes(2e9) == pytest.approx(32e9)


def test_zero3_over_8_devices_brings_it_to_4_gb_and_7_gb_with_activations():
    assert theory.memory_per_device_bytes(2e9, devices=8, zero_stage=3) == pytest.approx(4e9)
    assert theory.memory_per_device_bytes(2e9, devices=8, zero_stage=3, activation_bytes=3e9) == pytest.approx(7e9)


def test_busbw_is_algbw_times_2_n_minus_1_over_n():
    algbw = theory.algbw_bytes_per_s(400e6, 0.024030)
    assert theory.busbw_bytes_per_s(400e6, 0.024030, workers=4) == pytest.approx(algbw * 1.5)


# --- batch and learning rate --------------------------------------------------------------------


def test_linear_rule_multiplies_by_k_and_sqrt_rule_by_its_root():
    assert theory.scaled_learning_rate(0.1, 256, 1024, rule="linear") == pytest.approx(0.4)
    assert theory.scaled_learning_rate(0.1, 256, 1024, rule="sqrt") == pytest.approx(0.2)
    assert theory.scaled_learning_rate(0.1, 256, 256) == pytest.approx(0.1)


def test_unknown_lr_rule_names_the_rules():
    with pytest.raises(ValueError, match="unknown rule 'cubic': choose one of linear, sqrt"):
        theory.scaled_learning_rate(0.1, 256, 512, rule="cubic")


def test_accumulation_steps_reach_the_target_exactly_or_say_why_not():
    steps = theory.accumulation_steps_for(256, per_device_batch=8, devices=16)
    assert theory.global_batch_size(8, 16, steps) == 256
    with pytest.raises(ValueError, match="not a multiple"):
        theory.accumulation_steps_for(300, per_device_batch=8, devices=16)


def test_steps_per_epoch_keeps_or_drops_the_partial_batch():
    assert theory.steps_per_epoch(1000, 256) == 4
    assert theory.steps_per_epoch(1000, 256, drop_last=True) == 3
    assert theory.steps_per_epoch(0, 256) == 0


@pytest.mark.parametrize("drop_last", [False, True])
def test_samples_per_rank_matches_torch_distributed_sampler(drop_last):
    from torch.utils.data import DistributedSampler

    rng = random.Random(0)
    for _ in range(30):
        size, ranks = rng.randint(1, 500), rng.randint(1, 9)
        sampler = DistributedSampler(
            range(size), num_replicas=ranks, rank=ranks - 1, shuffle=False, drop_last=drop_last
        )
        assert theory.samples_per_rank(size, ranks, drop_last=drop_last) == len(list(sampler))
        if not drop_last:
            assert theory.sampler_padding_samples(size, ranks) == sampler.total_size - size


# --- communication ------------------------------------------------------------------------------


def test_counts_may_be_whole_floats():
    assert theory.samples_per_rank(1e6, 8.0) == 125_000
    assert isinstance(theory.global_batch_size(8.0, 16, 2), int)


def test_one_worker_communicates_nothing():
    assert theory.ring_allreduce_time_s(400e6, 1, 25e9, 5e-6) == 0
    assert theory.ring_allreduce_sent_bytes(400e6, 1) == 0
    assert theory.busbw_bytes_per_s(400e6, 0.01, workers=1) == 0


def test_zero_bytes_cost_only_latency():
    # A reduce-scatter's 3 steps, then an all-gather's 3: 6 x 5 us.
    assert theory.ring_allreduce_time_s(0, 4, 25e9, 5e-6) == pytest.approx(30e-6)
    assert theory.bucketed_allreduce_time_s(0, 25e6, 4, 25e9, 5e-6) == 0
    assert theory.algbw_bytes_per_s(0, 1.0) == 0


def test_ring_traffic_per_worker_stays_below_twice_the_buffer():
    sent = [theory.ring_allreduce_sent_bytes(1e9, n) for n in (2, 4, 64, 1024)]
    assert sent == sorted(sent)
    assert sent[0] == pytest.approx(1e9)
    assert all(s < 2e9 for s in sent)


def test_one_bucket_costs_the_same_as_one_allreduce_and_tiny_buckets_pay_latency_each():
    one_bucket = theory.bucketed_allreduce_time_s(100e6, 100e6, 8, 10e9, 50e-6)
    assert one_bucket == pytest.approx(theory.ring_allreduce_time_s(100e6, 8, 10e9, 50e-6))
    tiny = theory.bucketed_allreduce_time_s(100e6, 100e3, 8, 10e9, 50e-6)
    # 999 more all-reduces, each of 2(N-1) = 14 steps of 50 us.
    assert tiny - one_bucket == pytest.approx((1000 - 1) * 14 * 50e-6)


def test_parameter_server_load_grows_with_workers_and_shrinks_with_shards():
    assert theory.parameter_server_received_bytes(1e9, workers=8) == pytest.approx(8e9)
    assert theory.parameter_server_received_bytes(1e9, workers=8, servers=4) == pytest.approx(2e9)
    assert theory.parameter_server_time_s(1e9, 8, 10e9) == pytest.approx(0.8)


def test_synchronous_step_waits_for_the_slowest_and_async_staleness_is_n_minus_1():
    assert theory.synchronous_step_time_s([0.1, 0.3, 0.2]) == 0.3
    assert theory.expected_staleness_updates(8) == 7
    assert theory.expected_staleness_updates(1) == 0


def test_with_a_straggler_async_runs_at_the_workers_summed_rate_and_sync_at_the_slowest():
    assert theory.synchronous_run_time_s(30, [0.02, 0.06]) == pytest.approx(1.8)
    # 60 gradients from workers at 20 and 60 ms: 45 + 15 of them by 0.9 s.
    assert theory.asynchronous_run_time_s(60, [0.02, 0.06]) == pytest.approx(0.9)
    assert theory.asynchronous_run_time_s(1, [0.05, 0.03]) == pytest.approx(0.03)
    assert theory.asynchronous_run_time_s(0, [0.05]) == 0
    # A straggler's gradients are staler; the mean over all updates stays N-1.
    fast, slow = theory.worker_staleness_updates([0.02, 0.06])
    assert (fast, slow) == (pytest.approx(1 / 3), pytest.approx(3))
    rates = [1 / 0.02, 1 / 0.06]
    assert (rates[0] * fast + rates[1] * slow) / sum(rates) == pytest.approx(theory.expected_staleness_updates(2))
    assert theory.worker_staleness_updates([0.1] * 4) == [pytest.approx(3)] * 4


def test_overlap_hides_all_but_the_last_bucket_or_all_but_the_first_wait():
    one = theory.overlapped_backward_time_s(0.1, [100e6], 2, 1e9)
    assert one == pytest.approx(0.1 + theory.ring_allreduce_time_s(100e6, 2, 1e9))
    # A slow backward: the link keeps up, only the last bucket's all-reduce is left after it.
    compute_bound = theory.overlapped_backward_time_s(1.0, [10e6] * 10, 2, 1e9)
    assert compute_bound == pytest.approx(1.0 + 0.01)
    # A fast backward: the link is busy from the first bucket on; each all-reduce pays 2(N-1) = 2 latencies.
    link_bound = theory.overlapped_backward_time_s(0.01, [10e6] * 10, 2, 1e9, latency_s=1e-3)
    assert link_bound == pytest.approx(0.001 + 10 * (0.01 + 2e-3))


def test_fit_recovers_latency_and_bandwidth_from_exact_timings():
    sizes = [1e6, 4e6, 16e6, 64e6, 256e6]
    timings = [(s, theory.ring_allreduce_time_s(s, 4, 25e9, 5e-6)) for s in sizes]
    fit = theory.fit_latency_bandwidth(timings, workers=4)
    assert fit.latency_s == pytest.approx(5e-6, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(25e9, rel=1e-9)
    assert fit.allreduce_time_s(400e6, 4) == pytest.approx(24.030e-3)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "broadcast"])
def test_fit_of_another_collective_uses_its_own_steps_and_bytes(op):
    timings = [(s, theory.collective_time_s(op, s, 4, 3e9, 2e-5)) for s in (1e6, 8e6, 64e6)]
    fit = theory.fit_latency_bandwidth(timings, workers=4, op=op)
    assert fit.latency_s == pytest.approx(2e-5, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(3e9, rel=1e-9)
    # read as all-reduces, the same times give another link: the op matters
    assert theory.fit_latency_bandwidth(timings, workers=4).bandwidth_bytes_per_s != pytest.approx(3e9, rel=0.01)


def test_fit_accepts_measurements_at_several_world_sizes():
    triples = [(n, s, theory.ring_allreduce_time_s(s, n, 1e9, 2e-4)) for n in (2, 4, 8) for s in (1e6, 32e6)]
    fit = theory.fit_latency_bandwidth(triples)
    assert fit.latency_s == pytest.approx(2e-4, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)


def test_fit_tolerates_noise_and_clamps_a_negative_latency_to_zero():
    rng = random.Random(1)
    noisy = [(s, theory.ring_allreduce_time_s(s, 2, 1e9) * rng.uniform(0.97, 1.03)) for s in (1e6, 8e6, 64e6) * 3]
    fit = theory.fit_latency_bandwidth(noisy, workers=2)
    assert fit.latency_s >= 0
    assert fit.bandwidth_bytes_per_s == pytest.approx(1e9, rel=0.05)


@pytest.mark.parametrize(
    ("measurements", "workers", "message"),
    [
        ([(1e6, 0.01)], 2, "two or more different sizes"),
        ([(1e6, 0.01), (1e6, 0.02)], 2, "two or more different sizes"),
        ([(1e6, 0.02), (8e6, 0.01)], 2, "do not grow with the size"),
        ([(1e6, 0.01), (2e6, 0.02)], None, r"\(workers, size_bytes, time_s\)"),
        ([(1, 1e6, 0.01), (1, 2e6, 0.02)], None, "workers of measurements\\[0\\] must be >= 2"),
        ([(1e6, 0.0), (2e6, 0.02)], 2, "time_s of measurements\\[0\\] must be a number > 0"),
    ],
)
def test_fit_says_what_is_wrong_with_the_measurements(measurements, workers, message):
    with pytest.raises(ValueError, match=message):
        theory.fit_latency_bandwidth(measurements, workers=workers)


# --- memory -------------------------------------------------------------------------------------


def test_each_zero_stage_shards_one_more_kind_of_state():
    states = [theory.memory_breakdown(1e9, devices=4, zero_stage=stage) for stage in range(4)]
    assert [s.optimizer_states_bytes for s in states] == pytest.approx([12e9, 3e9, 3e9, 3e9])
    assert [s.gradients_bytes for s in states] == pytest.approx([2e9, 2e9, 0.5e9, 0.5e9])
    assert [s.weights_bytes for s in states] == pytest.approx([2e9, 2e9, 2e9, 0.5e9])
    totals = [s.total_bytes for s in states]
    assert totals == sorted(totals, reverse=True)


def test_sharding_over_one_device_changes_nothing():
    assert theory.memory_per_device_bytes(1e9, devices=1, zero_stage=3) == theory.memory_per_device_bytes(1e9)


@pytest.mark.parametrize(
    ("precision", "optimizer", "expected"),
    [("mixed", "adam", 16), ("fp32", "adam", 16), ("fp32", "momentum", 12), ("fp32", "sgd", 8), ("mixed", "sgd", 8)],
)
def test_bytes_per_parameter_by_precision_and_optimizer(precision, optimizer, expected):
    assert theory.bytes_per_parameter(precision, optimizer) == expected


def test_both_mixed_precision_layouts_cost_16_bytes_with_adam_but_split_them_differently():
    autocast = theory.state_bytes_per_parameter("autocast", "adam")  # fp32 weights and grads, no master
    zero = theory.state_bytes_per_parameter("mixed", "adam")  # 16-bit weights and grads, fp32 master
    assert (autocast.weights, autocast.gradients, autocast.optimizer_states) == (4, 4, 8)
    assert (zero.weights, zero.gradients, zero.optimizer_states) == (2, 2, 12)
    assert autocast.total == zero.total == 16
    # ZeRO-1 shards only optimizer states: what stays whole differs.
    assert theory.memory_per_device_bytes(1, devices=8, zero_stage=1, precision="autocast") == 9
    assert theory.memory_per_device_bytes(1, devices=8, zero_stage=1, precision="mixed") == 5.5


def test_activation_bytes_multiply_the_shape_out():
    assert theory.activation_bytes(4, 2048, 4096, bytes_per_element=2) == 4 * 2048 * 4096 * 2


# --- pipelines and scaling ----------------------------------------------------------------------


def test_pipeline_bubble_fraction():
    assert theory.pipeline_bubble_fraction(stages=4, micro_batches=8) == pytest.approx(3 / 11)
    assert theory.pipeline_bubble_fraction(stages=1, micro_batches=1) == 0


def test_fewest_micro_batches_meet_the_bubble_limit_and_one_fewer_does_not():
    for stages in range(2, 17):
        for limit in (0.05, 0.1, 0.2, 0.25, 0.5, 0.9):
            m = theory.micro_batches_for_bubble(stages, limit)
            assert theory.pipeline_bubble_fraction(stages, m) <= limit + 1e-12
            if m > 1:
                assert theory.pipeline_bubble_fraction(stages, m - 1) > limit


def test_a_bubble_of_zero_is_possible_only_without_a_pipeline():
    assert theory.micro_batches_for_bubble(1, 0.0) == 1
    with pytest.raises(ValueError, match="always has a bubble"):
        theory.micro_batches_for_bubble(4, 0.0)


def test_expected_efficiency_counts_only_exposed_communication():
    assert theory.expected_scaling_efficiency(0.1, 0.1) == pytest.approx(0.5)
    assert theory.expected_scaling_efficiency(0.1, 0.1, overlap_fraction=1.0) == pytest.approx(1.0)
    assert theory.compute_comm_ratio(0.2, 0.1) == pytest.approx(2.0)
    assert theory.compute_comm_ratio(0.2, 0.0) == math.inf


def test_speedup_efficiency_amdahl_and_linear_time():
    assert theory.speedup(100, 40) == pytest.approx(2.5)
    assert theory.parallel_efficiency(100, 40, workers=4) == pytest.approx(0.625)
    assert theory.amdahl_speedup(1.0, 8) == pytest.approx(8)
    assert theory.amdahl_speedup(0.9, 10**9) == pytest.approx(10, rel=1e-6)
    assert theory.training_time_s(2000, 0.5) == 2 * theory.training_time_s(1000, 0.5)
    assert theory.epoch_time_s(1e6, 1000, devices=4, scaling_efficiency=0.5) == pytest.approx(500)


def test_strong_scaling_divides_compute_and_adds_communication_and_weak_scaling_is_no_speedup():
    assert theory.strong_scaling_speedup(0.2, 0.0, 4) == pytest.approx(4)
    assert theory.strong_scaling_speedup(0.2, 0.01, 2) == pytest.approx(0.2 / 0.11)
    assert theory.strong_scaling_speedup(0.2, 0.01, 2, overlap_fraction=1.0) == pytest.approx(2)
    # Its efficiency is the expected efficiency of one worker's share of the job.
    efficiency = theory.strong_scaling_speedup(0.2, 0.01, 2) / 2
    assert efficiency == pytest.approx(theory.expected_scaling_efficiency(0.1, 0.01))
    assert theory.weak_scaling_efficiency(100, 125) == pytest.approx(0.8)


def test_weak_scaling_efficiency_falls_with_n_as_the_ring_grows():
    comm = [theory.ring_allreduce_time_s(100e6, n, 10e9, 5e-6) for n in (2, 4, 8, 64)]
    efficiency = [theory.expected_scaling_efficiency(0.05, c) for c in comm]
    assert efficiency == sorted(efficiency, reverse=True)


def test_the_planning_exercise_ddp_does_not_fit_and_the_worked_zero1_plan_holds():
    job = theory.TrainingJob()
    metrics = ["loss", "throughput", "peak_memory"]
    ddp = theory.check_plan("ddp", 16, 3, 3.375e-4, metrics, job)
    assert ddp.verdicts()["memory per device"] is False  # 16 GB of states alone
    worked = theory.check_plan("zero1", 16, 3, 3.375e-4, metrics)
    assert worked.holds and worked.global_batch == 288
    assert worked.memory_per_device_bytes == pytest.approx(6e9 + 16 * 0.25e9)
    fsdp = theory.check_plan("fsdp", 16, 1, 3e-4 * 96 / 256, metrics)
    assert fsdp.memory_per_device_bytes == pytest.approx(16e9 / 6 + 4e9)
    # A learning rate left at the recipe's for a 48-sample batch, and no speed metric.
    wrong = theory.check_plan("zero3", 8, 1, 3e-4, ["loss", "grad_norm", "validation_loss"])
    assert wrong.verdicts() == {
        "memory per device": True,
        "finishes in time": False,
        "learning rate for the global batch": False,
        "three metrics to watch": False,
    }
    assert "FAILS" in str(wrong) and "does not hold" in str(wrong)


def test_zero2_and_zero3_communicate_per_micro_batch_and_ddp_once_per_step():
    one = theory.ring_allreduce_time_s(2e9, 6, 10e9)
    assert one == pytest.approx(2 * 5 / 6 * 2e9 / 10e9)
    assert theory.communication_per_step_s("ddp", 4, 2e9, 6, 10e9) == pytest.approx(one)
    assert theory.communication_per_step_s("zero2", 3, 2e9, 6, 10e9) == pytest.approx(2 * one)
    assert theory.communication_per_step_s("fsdp", 4, 2e9, 6, 10e9) == pytest.approx(6 * one)


def test_zero1_as_pytorch_builds_it_adds_a_broadcast_of_the_updated_shards_to_ddps_allreduce():
    # ZeroRedundancyOptimizer under DDP: DDP's all-reduce of the 2 GB, 2(5/6) x 2 GB / 10 GB/s + 10 x 10 us,
    # then every rank's updated shard to the 5 others, an all-gather's 5/6 x 2 GB / 10 GB/s + 5 x 10 us.
    ddp = 2 * 5 / 6 * 2e9 / 10e9 + 10 * 10e-6
    broadcasts = 5 / 6 * 2e9 / 10e9 + 5 * 10e-6
    assert theory.communication_per_step_s("ddp", 3, 2e9, 6, 10e9, 10e-6) == pytest.approx(ddp)
    assert theory.communication_per_step_s("zero1", 3, 2e9, 6, 10e9, 10e-6) == pytest.approx(ddp + broadcasts)
    assert ddp + broadcasts == pytest.approx(0.50015)
    # The planning exercise's worked ZeRO-1 plan: 16 x 3 samples at 8 per second, then those 0.5 s.
    worked = theory.check_plan("zero1", 16, 3, 3.375e-4, ["loss", "throughput", "peak_memory"])
    assert worked.step_time_s == pytest.approx(6 + 0.50015)


def test_a_plan_with_an_unknown_parallelism_or_metric_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown parallelism 'tp': choose one of ddp, zero1"):
        theory.check_plan("tp", 8, 1, 1e-4, ["loss", "throughput", "peak_memory"])
    with pytest.raises(ValueError, match="unknown metric 'accuracy'"):
        theory.check_plan("zero1", 8, 1, 1e-4, ["loss", "accuracy", "peak_memory"])
    with pytest.raises(ValueError, match="metrics must be a list"):
        theory.check_plan("zero1", 8, 1, 1e-4, "loss")


# --- ranks, metrics, faults ---------------------------------------------------------------------


def test_torchrun_rank_arithmetic():
    assert theory.world_size(nodes=2, processes_per_node=8) == 16
    assert theory.global_rank(node_rank=1, local_rank=3, processes_per_node=8) == 11
    with pytest.raises(ValueError, match="local_rank must be below processes_per_node"):
        theory.global_rank(node_rank=0, local_rank=8, processes_per_node=8)


def test_global_mean_weights_by_count_not_by_rank():
    assert theory.global_mean([10.0, 90.0], [10, 90]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="one count per sum"):
        theory.global_mean([1.0, 2.0], [1])
    with pytest.raises(ValueError, match="no mean of zero samples"):
        theory.global_mean([0.0], [0])


def test_fault_tolerance_formulas():
    assert theory.lost_work_s(elapsed_s=4000, checkpoint_interval_s=1800) == pytest.approx(400)
    assert theory.cluster_mtbf_s(device_mtbf_s=1000.0, devices=10) == pytest.approx(100.0)
    assert theory.optimal_checkpoint_interval_s(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400))


# --- units and argument checks --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "unit", "expected"),
    [
        ("24", "ms", 0.024),
        ("24 ms", "ms", 0.024),
        ("0.024 s", "ms", 0.024),
        ("24ms", "s", 0.024),
        ("400 MB", "B", 400e6),
        ("1 GiB", "B", 2**30),
        ("25 GB/s", "B/s", 25e9),
        ("8 Gbit/s", "GB/s", 1e9),
        ("50%", "%", 0.5),
        ("5 us", "s", 5e-6),
        ("2e3", "", 2000),
    ],
)
def test_parse_quantity_reads_numbers_with_and_without_units(text, unit, expected):
    assert theory.parse_quantity(text, unit) == pytest.approx(expected)


def test_converting_to_and_from_base_units_round_trips():
    for unit in theory.UNITS:
        assert theory.from_base_units(theory.to_base_units(3.5, unit), unit) == pytest.approx(3.5)


def test_unknown_unit_lists_the_units_of_the_right_kind():
    with pytest.raises(ValueError, match=r"unknown unit 'parsecs' in '24 parsecs'; use one of s, ms, us"):
        theory.parse_quantity("24 parsecs", "ms")
    with pytest.raises(ValueError, match="unknown unit 'Mb'"):
        theory.to_base_units(1, "Mb")


def test_a_unit_of_the_wrong_kind_is_refused():
    with pytest.raises(ValueError, match="'5 MB' is a size in bytes, not a time"):
        theory.parse_quantity("5 MB", "ms")


def test_text_where_a_number_belongs_points_to_parse_quantity():
    with pytest.raises(
        ValueError, match=r"size_bytes must be a number \(got '400 MB'\); convert text first, e\.g\. parse_quantity"
    ):
        theory.ring_allreduce_time_s("400 MB", 4, 25e9)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: theory.ring_allreduce_time_s(-1, 4, 25e9), "size_bytes must be >= 0"),
        (lambda: theory.ring_allreduce_time_s(1e6, 0, 25e9), "workers must be >= 1"),
        (
            lambda: theory.ring_allreduce_time_s(1e6, 4.5, 25e9),  # type: ignore[arg-type]
            r"workers must be a whole number \(got 4.5\)",
        ),
        (lambda: theory.ring_allreduce_time_s(1e6, 4, 0), "bandwidth_bytes_per_s must be a number > 0"),
        (lambda: theory.ring_allreduce_time_s(1e6, 4, math.inf), "bandwidth_bytes_per_s must be finite"),
        (lambda: theory.ring_allreduce_time_s(1e6, True, 25e9), "workers must be a whole number"),
        (lambda: theory.global_batch_size(8, 0), "devices must be >= 1"),
        (lambda: theory.memory_per_device_bytes(1e9, zero_stage=4), "zero_stage must be 0 \\(plain DDP\\), 1, 2 or 3"),
        (lambda: theory.bytes_per_parameter("fp8"), "unknown precision 'fp8': choose one of fp32, mixed"),
        (
            lambda: theory.bytes_per_parameter("mixed", "lamb"),
            "unknown optimizer 'lamb': choose one of adam, momentum, sgd",
        ),
        (lambda: theory.pipeline_bubble_fraction(0, 4), "stages must be >= 1"),
        (lambda: theory.expected_scaling_efficiency(0.1, 0.1, overlap_fraction=80), "a fraction: give a value from 0"),
        (lambda: theory.synchronous_step_time_s([]), "non-empty list"),
    ],
)
def test_bad_arguments_raise_value_errors_that_name_them(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_names_carry_their_dimension_by_suffix():
    # The quiz checks a question's unit against the theory function's name, so the rule must hold.
    assert theory.dimension_of("ring_allreduce_time_s") == "time"
    assert theory.dimension_of("memory_per_device_bytes") == "bytes"
    assert theory.dimension_of("busbw_bytes_per_s") == "bandwidth"
    assert theory.dimension_of("pipeline_bubble_fraction") == "number"
