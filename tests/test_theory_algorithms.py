"""theory.algorithm_times: the algorithm NCCL would run a collective with, and its time."""

from __future__ import annotations

import pytest

from distlab import theory
from distlab.theory.algorithms import NVLS_GAIN

NODE = {"node_bytes_per_s": 450e9, "node_latency_s": 3e-6}  # an H100 node's NVLink (the predictor's profile)
NET = {"network_bytes_per_s": 50e9, "network_latency_s": 5e-6}  # a 400 Gb/s NIC per GPU


def _chosen(*args, **kwargs) -> str:
    return theory.algorithm_times(*args, **kwargs)[0].algorithm


def test_a_ring_on_one_node_is_the_latency_bandwidth_models_ring():
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        (ring,) = [a for a in theory.algorithm_times(op, 64e6, 8, 8, **NODE) if a.algorithm == "ring"]
        assert ring.seconds == pytest.approx(theory.collective_time_s(op, 64e6, 8, 450e9, 3e-6))


def test_a_small_all_reduce_over_1024_gpus_runs_on_a_tree_whose_latency_grows_with_log_nodes():
    times = {a.algorithm: a for a in theory.algorithm_times("all_reduce", 1e6, 1024, 8, **NODE, **NET)}
    assert _chosen("all_reduce", 1e6, 1024, 8, **NODE, **NET) == "tree"
    # up and down: 7 NVLink hops and log2(128) = 7 network hops each way
    assert times["tree"].latency_s == pytest.approx(2 * (7 * 3e-6 + 7 * 5e-6))
    # the ring: 2 x 1,023 steps, of which 2 x 127 leave a node
    assert times["ring"].latency_s == pytest.approx(2 * 896 * 3e-6 + 2 * 127 * 5e-6)
    assert times["ring"].seconds > 40 * times["tree"].seconds
    # doubling the nodes adds two network hops to the tree, 2 x 128 steps to the ring
    wider = {a.algorithm: a for a in theory.algorithm_times("all_reduce", 1e6, 2048, 8, **NODE, **NET)}
    assert wider["tree"].latency_s - times["tree"].latency_s == pytest.approx(2 * 5e-6)


def test_a_large_all_reduce_across_nodes_goes_back_to_the_ring_at_a_size_between():
    sizes = [2**k for k in range(10, 34)]
    chosen = [_chosen("all_reduce", s, 64, 8, **NODE, **NET) for s in sizes]
    assert chosen[0] == "tree" and chosen[-1] == "ring"
    flip = chosen.index("ring")
    assert set(chosen[flip:]) == {"ring"}, chosen  # one crossover: the ring's bandwidth wins from there


def test_nvls_reduces_in_the_switch_of_one_node_only_and_only_where_the_node_has_one():
    assert _chosen("all_reduce", 256e6, 8, 8, **NODE, nvls=True) == "nvls"
    nvls = theory.algorithm_times("all_reduce", 256e6, 8, 8, **NODE, nvls=True)[0]
    ring = theory.collective_time_s("all_reduce", 256e6, 8, 450e9, 3e-6)
    assert ring / nvls.seconds == pytest.approx(NVLS_GAIN, rel=0.05)  # bandwidth-bound: 480 vs 370 GB/s
    assert _chosen("all_reduce", 256e6, 8, 8, **NODE) == "ring"  # no NVSwitch (an A100 node)
    across = {a.algorithm for a in theory.algorithm_times("all_reduce", 256e6, 16, 8, **NODE, **NET, nvls=True)}
    assert "nvls" not in across  # across nodes it needs InfiniBand SHARP, not modelled
    assert "nvls" not in {a.algorithm for a in theory.algorithm_times("all_gather", 256e6, 8, 8, **NODE, nvls=True)}


def test_pat_gathers_small_shards_across_one_rank_per_node_and_the_ring_large_ones():
    # FSDP's group under TP 8: one rank on each of 128 nodes
    assert _chosen("all_gather", 1e6, 128, 1, **NODE, **NET) == "pat"
    assert _chosen("reduce_scatter", 1e6, 128, 1, **NODE, **NET) == "pat"
    assert _chosen("all_gather", 1e9, 128, 1, **NODE, **NET) == "ring"  # PAT runs at 0.75 of the link
    assert "pat" not in {a.algorithm for a in theory.algorithm_times("all_gather", 1e6, 256, 2, **NODE, **NET)}


def test_the_fastest_is_what_nccl_collective_time_s_says():
    args = ("all_reduce", 4e6, 256, 8)
    links = (*NODE.values(), *NET.values())
    assert theory.nccl_collective_time_s(*args, *links) == min(a.seconds for a in theory.algorithm_times(*args, *links))


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("all_reduce", 1e6, 12, 8), NODE | NET, "ranks_per_node (8) must divide world_size (12)"),
        (("all_reduce", 1e6, 16, 8), NODE, "network_bytes_per_s"),
        (("all_to_all", 1e6, 8, 8), NODE, "op"),
        (("all_reduce", -1, 8, 8), NODE, "size_bytes"),
    ],
)
def test_bad_arguments_get_one_line_naming_them(args, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        theory.algorithm_times(*args, **kwargs)


def test_the_quiz_question_on_1024_gpus_says_what_the_theory_computes():
    import json
    from pathlib import Path

    import distlab.quiz

    bank = Path(distlab.quiz.__file__).parent / "bank" / "communication-cost.json"
    (question,) = [q for q in json.loads(bank.read_text())["questions"]
                   if q["id"] == "communication-cost/allreduce-at-1024-gpus"]
    times = {a.algorithm: a for a in theory.algorithm_times(
        "all_reduce", 1e6, 1024, 8, 450e9, 3e-6, 50e9, 5e-6, nvls=True)}
    (correct,) = [o for o in question["options"] if o["correct"]]
    assert correct["id"] == min(times.values(), key=lambda a: a.seconds).algorithm
    assert round(times["tree"].latency_s * 1e6) == 112 and "112 us" in question["explanation"]
    assert round(times["ring"].latency_s * 1e3, 1) == 6.6 and "6.6 ms" in question["explanation"]
