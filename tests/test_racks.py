"""A lab on two tiers: nodes in racks, each rack's switch joined to a spine by one shaped uplink.

Real gloo traffic across real namespaces: what stays inside a rack, what crosses the uplinks (as
many bytes as the ring model says), the uplink as the bottleneck between racks, reshaped between
cells, and nothing left after the lab. Needs root (CAP_NET_ADMIN), as CI has.
"""

from __future__ import annotations

import pytest
from conftest import lab_namespaces

import distlab
from distlab import theory
from distlab.errors import LabUsageError

pytestmark = pytest.mark.cluster

MB = 2**20
UPLINK = "100mbit"


@pytest.fixture(scope="module")
def racks_lab():
    before = lab_namespaces()
    lab = distlab.start(ranks=4, nodes=4, racks=2, link="1gbit", uplink=UPLINK, timeout=60)
    try:
        yield lab
    finally:
        lab.stop()
        assert lab_namespaces() == before  # spine, racks and nodes: all gone


def _uplink_delta(lab, code: str, ranks: list[int]) -> dict[int, tuple[int, int]]:
    before = lab.uplink_bytes()
    lab.run(code, ranks=ranks, stream=False, timeout=120)
    after = lab.uplink_bytes()
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}


def test_ranks_sit_in_racks_and_the_status_shows_both_tiers(racks_lab):
    assert racks_lab.racks == [[0, 1], [2, 3]]
    assert [r.host for r in racks_lab.table] == ["node0", "node1", "node2", "node3"]
    shown = str(racks_lab.status())
    assert "4 nodes in 2 racks (rack0: node0 node1, rack1: node2 node3)" in shown and f"uplink {UPLINK}" in shown
    queues = racks_lab.processes.network.queues()
    uplinks = [q for end, q in queues.items() if end.endswith(("/up0", "/r0", "/r1"))]
    assert len(queues) == 12 and len(uplinks) == 4  # both ends of 4 links and of 2 uplinks
    assert all("rate 100Mbit" in q for q in uplinks) and sum("rate 1Gbit" in q for q in queues.values()) == 8


def test_traffic_inside_a_rack_stays_off_the_uplinks_and_a_flat_ring_crosses_each_as_the_model_says(racks_lab):
    racks_lab.run("in_rack = dist.new_group([0, 1])", stream=False)
    size = 4 * MB
    inside = _uplink_delta(racks_lab, f"dist.all_reduce(torch.ones({size // 4}), group=in_rack)", [0, 1])
    assert all(up + down < size / 8 for up, down in inside.values()), inside  # only the control chatter
    flat = _uplink_delta(racks_lab, f"dist.all_reduce(torch.ones({size // 4}))", [0, 1, 2, 3])
    # Each rack's uplink carries its one ring edge each way: 2(N-1)/N * S = 1.5 S up and 1.5 S down.
    expected = {rack: crossings * theory.ring_allreduce_sent_bytes(size, 4)
                for rack, crossings in theory.ring_uplink_crossings([0, 0, 1, 1]).items()}
    for rack, (up, down) in flat.items():
        # Frames carry headers (about 5% at 1500-byte frames) and the ranks' control chatter.
        assert expected[rack] <= up < 1.25 * expected[rack] and expected[rack] <= down < 1.25 * expected[rack], flat


def test_the_uplink_bounds_traffic_between_racks_and_is_reshaped_between_cells(racks_lab):
    racks_lab.run("across = dist.new_group([0, 2])", stream=False)
    new = racks_lab.set_uplink("40mbit")
    assert racks_lab.uplink == new and new.rate_bps == 40_000_000 and str(racks_lab.link) == "1gbit"
    size = 2 * MB
    took = racks_lab.run(
        f"import time\nx = torch.ones({size // 4})\ndist.barrier(group=across)\n"
        "t0 = time.perf_counter(); dist.all_reduce(x, group=across); time.perf_counter() - t0",
        ranks=[0, 2], stream=False, timeout=60,
    )
    # No faster than the uplink allows (a bound the kernel sets, not a speed target): a 2-rank ring
    # sends S each way across it, and the 1 Gbit/s links would allow 25 times that.
    floor = theory.tiered_allreduce_time_s(size, [0, 2], 1e9 / 8, [0, 1], new.bytes_per_s)
    assert min(took.values()) > 0.9 * floor, (took, floor)
    with pytest.raises(LabUsageError, match="uplink must be a bandwidth with a unit"):
        racks_lab.set_uplink("fast")
    assert racks_lab.uplink == new  # a bad value changes nothing
    racks_lab.set_uplink(None)
    assert racks_lab.uplink is None
    queues = racks_lab.processes.network.queues()
    assert not any("tbf" in q for end, q in queues.items() if end.endswith(("/up0", "/r0", "/r1")))
    racks_lab.set_uplink(UPLINK)


def test_the_magics_start_racks_and_change_the_uplink_between_cells(ipython, capsys):
    ipython.run_line_magic("dist", "start -n 2 --nodes 2 --racks 2 --link 1gbit --uplink 200mbit")
    out = capsys.readouterr().out
    assert "2 ranks ready on 2 nodes (link 1gbit) in 2 racks (uplink 200mbit)" in out, out
    lab = distlab.front.magics._registered[id(ipython)].lab
    ipython.run_line_magic("dist", "link --uplink 50mbit")
    out = capsys.readouterr().out
    assert "link: 1gbit (each way, every node's link to its rack's switch)" in out
    assert "uplink: 50mbit (each way, every rack's link to the spine)" in out and lab.uplink.rate_bps == 50_000_000
    assert lab.run("dist.get_world_size()", stream=False) == {0: 2, 1: 2}


def test_the_side_panels_record_holds_the_racks_and_their_uplink(racks_lab):
    from distlab.server import registry

    mine = next(lab for lab in registry.read_labs() if lab["id"] == registry.id_of(racks_lab))
    assert mine["nodes"] == 4 and mine["racks"] == [[0, 1], [2, 3]] and mine["uplink"] == str(racks_lab.uplink)
