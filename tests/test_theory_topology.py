"""distlab.theory's ring on two tiers: which edge is the slowest, and what a ring all-reduce then takes."""

from __future__ import annotations

import math

import pytest

from distlab import theory

MB = 2**20
LINK, UPLINK = 1e9 / 8, 1e8 / 8  # 1 Gbit/s links, 100 Mbit/s uplinks, in bytes/s


def test_on_a_star_with_one_rank_per_node_it_is_the_plain_ring():
    for n in (2, 3, 4):
        assert theory.tiered_allreduce_time_s(16 * MB, list(range(n)), LINK, latency_s=1e-4) == pytest.approx(
            theory.ring_allreduce_time_s(16 * MB, n, LINK, 1e-4)
        )


def test_racks_visited_in_order_cross_each_uplink_once_and_run_at_its_rate():
    rates = theory.ring_edge_bandwidths([0, 1, 2, 3], LINK, racks=[0, 0, 1, 1], uplink_bytes_per_s=UPLINK)
    assert rates == [LINK, UPLINK, LINK, UPLINK]  # 0->1 in rack 0, 1->2 up and over, 2->3, 3->0 back
    assert theory.ring_uplink_crossings([0, 0, 1, 1]) == {0: 1, 1: 1}
    # 2(N-1)/N * S over the slowest edge: 1.5 S at 100 Mbit/s.
    assert theory.tiered_allreduce_time_s(8 * MB, [0, 1, 2, 3], LINK, [0, 0, 1, 1], UPLINK) == pytest.approx(
        1.5 * 8 * MB / UPLINK
    )


def test_a_ring_that_alternates_racks_shares_each_uplink_and_is_slower():
    in_order = theory.tiered_allreduce_time_s(8 * MB, [0, 1, 2, 3], LINK, [0, 0, 1, 1], UPLINK)
    alternating = theory.tiered_allreduce_time_s(8 * MB, [0, 2, 1, 3], LINK, [0, 1, 0, 1], UPLINK)
    assert theory.ring_uplink_crossings([0, 1, 0, 1]) == {0: 2, 1: 2}
    assert alternating == pytest.approx(2 * in_order)  # every edge crosses; two share each uplink
    # Uplinks twice as fast as the links carry the two crossings each at the link's rate: the
    # alternating ring then runs as a plain ring; as fast as the links (None), at half of it.
    assert theory.tiered_allreduce_time_s(8 * MB, [0, 2, 1, 3], LINK, [0, 1, 0, 1], 2 * LINK) == pytest.approx(
        theory.ring_allreduce_time_s(8 * MB, 4, LINK)
    )
    assert theory.tiered_allreduce_time_s(8 * MB, [0, 2, 1, 3], LINK, [0, 1, 0, 1]) == pytest.approx(
        theory.ring_allreduce_time_s(8 * MB, 4, LINK / 2)
    )


def test_ranks_of_one_node_talk_over_loopback_and_its_link_is_shared_only_by_edges_leaving_it():
    rates = theory.ring_edge_bandwidths([0, 0, 1, 1], LINK)
    assert rates[0] == math.inf and rates[2] == math.inf and rates[1] == rates[3] == LINK
    # Two ranks per node in an interleaved ring: both of a node's edges leave over its one link.
    assert theory.ring_edge_bandwidths([0, 1, 0, 1], LINK) == [LINK / 2] * 4
    assert theory.tiered_allreduce_time_s(8 * MB, [0, 0], LINK, latency_s=1e-3) == pytest.approx(2e-3)
    assert theory.tiered_allreduce_time_s(8 * MB, [0], LINK) == 0.0


@pytest.mark.parametrize(
    "args, fragment",
    [
        (([], LINK), "nodes must list each rank's node"),
        (([0, 1], LINK, [0]), "one per rank as nodes does"),
        (([0, 0, 1], LINK, [0, 1, 1]), "node 0 is given two racks"),
        (([0, 1], 0.0), "link_bytes_per_s must be a number > 0"),
        (([0, 1], LINK, [0, 1], -1.0), "uplink_bytes_per_s must be a number > 0"),
    ],
)
def test_bad_placements_and_rates_are_refused_with_the_fix(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        theory.ring_edge_bandwidths(*args)


def test_hsdp_keeps_the_gathers_in_the_rack_and_sends_one_all_reduce_up_whatever_the_rack_size():
    psi = 100 * MB
    flat = theory.fsdp_uplink_bytes_per_step(psi, racks=2, ranks_per_rack=2, layout="flat")
    hsdp = theory.fsdp_uplink_bytes_per_step(psi, racks=2, ranks_per_rack=2, layout="hsdp")
    across = theory.fsdp_uplink_bytes_per_step(psi, racks=2, ranks_per_rack=2, layout="shard-across")
    assert flat == pytest.approx(3 * 3 / 4 * psi)  # two all-gathers and a reduce-scatter, one crossing each
    assert hsdp == pytest.approx(psi)  # two replicas: 2(R-1)/R of Psi, in shards of Psi/k
    assert across == pytest.approx(2 * 3 / 2 * psi)  # both shard groups cross: the mesh put the wrong way
    assert theory.fsdp_uplink_bytes_per_step(psi, 2, 8, "hsdp") == pytest.approx(hsdp)  # k does not matter
    # Without the backward all-gather, and with gloo's reduce-scatter that moves an all-reduce's bytes.
    assert theory.fsdp_uplink_bytes_per_step(psi, 2, 2, "flat", reshard_after_forward=False) == pytest.approx(
        2 * 3 / 4 * psi)
    assert theory.fsdp_uplink_bytes_per_step(psi, 2, 2, "flat", reduce_scatter="all_reduce") == pytest.approx(3 * psi)
    # Flat FSDP over one rack per rank is every rank's own fsdp_bytes_per_step.
    assert theory.fsdp_uplink_bytes_per_step(psi, 4, 1, "flat") == pytest.approx(theory.fsdp_bytes_per_step(psi, 4))
    with pytest.raises(ValueError, match="unknown layout 'zero'"):
        theory.fsdp_uplink_bytes_per_step(psi, 2, 2, "zero")
