"""A lab on emulated nodes: network namespaces joined to a switch by shaped links, real gloo traffic across them.

Everything distlab does on one host is done here across two nodes of two ranks each: the rank table,
DDP, output, errors, hangs and their release, kill and restart, watch, checkpoints, the side panel's
view, and cleaning up. Needs root (CAP_NET_ADMIN), as CI has; without it, test_nodes_without_root.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import threading

import psutil
import pytest
import torch
from conftest import lab_namespaces, rank_lines
from test_ddp_correctness import TRAIN, reference
from test_faults import TRAIN_ONE_EPOCH

import distlab
from distlab.cluster import nodes as nodes_mod
from distlab.errors import CellTimeout, LabUsageError, RankError
from distlab.server import registry

pytestmark = pytest.mark.cluster

LINK = "1gbit"
ALL_REDUCE_ONE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"



@pytest.fixture(scope="module")
def _nodes_lab():
    lab = distlab.start(ranks=4, nodes=2, link=LINK, timeout=30)
    try:
        yield lab
    finally:
        lab.stop()


@pytest.fixture
def nodes_lab(_nodes_lab):
    """The 4-rank, 2-node lab, healthy and on its own link, whatever the test before left."""
    if _nodes_lab.world_size != 4 or any(r.health != "ok" for r in _nodes_lab.status()):
        _nodes_lab.restart(ranks=4)
    if str(_nodes_lab.link) != LINK:
        _nodes_lab.set_link(LINK)
    return _nodes_lab


def test_ranks_are_grouped_by_node_and_reach_rank_0_at_node_0s_address(nodes_lab):
    table = nodes_lab.status()
    assert [(r.rank, r.host, r.local_rank) for r in table] == [
        (0, "node0", 0), (1, "node0", 1), (2, "node1", 0), (3, "node1", 1)
    ]
    subnet = nodes_lab.processes.network.subnet
    assert subnet.subnet_of(ipaddress.ip_network("198.18.0.0/15"))
    assert table[0].addr == table[1].addr != table[2].addr == table[3].addr
    assert all(ipaddress.ip_address(r.addr) in subnet for r in table)
    assert "2 nodes on" in str(table) and f"link {LINK}" in str(table)
    seen = nodes_lab.run(
        "import os, psutil\n"
        "routes = [line.split()[1] for line in open('/proc/net/route').read().splitlines()[1:]]\n"
        "(os.environ['MASTER_ADDR'], os.environ['LOCAL_RANK'], sorted(psutil.net_if_addrs()), routes,\n"
        " [os.environ[k] for k in ('GROUP_RANK', 'GROUP_WORLD_SIZE', 'LOCAL_WORLD_SIZE')])",
        stream=False,
    )
    for rank, (master, local_rank, interfaces, routes, torchrun_node) in seen.items():
        assert master == table[0].addr != "127.0.0.1"
        assert int(local_rank) == table[rank].local_rank
        assert torchrun_node == [str(rank // 2), "2", "2"]  # torchrun's node index, node count, ranks per node
        assert interfaces == ["eth0", "lo"]  # the node's own loopback and its one link
        assert "00000000" not in routes  # no default route: nothing leaves the lab's network


def test_each_rank_is_forked_warm_into_its_nodes_network_namespace(nodes_lab):
    # Forked from this process's warm template (torch already imported), then moved into its node:
    # the namespace the node's link ends in, not this machine's.
    network = nodes_lab.processes.network
    for r in nodes_lab.status():
        parent = psutil.Process(r.pid).parent()
        assert parent is not None and parent.cmdline()[-2:] == ["distlab.rank.warm_template", str(os.getpid())], (
            r, parent.cmdline() if parent else None)
        node = int(r.host.removeprefix("node"))
        netns = os.path.join("/run/netns", network.node_ns(node))
        assert os.stat(f"/proc/{r.pid}/ns/net").st_ino == os.stat(netns).st_ino, (r, netns)
        assert os.stat(f"/proc/{r.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino


def test_traffic_between_nodes_crosses_the_link_and_traffic_within_a_node_does_not(nodes_lab):
    nodes_lab.run("same_node = dist.new_group([0, 1])\nacross = dist.new_group([0, 2])", stream=False)
    size = 4 * 2**20  # bytes of float32

    def sent_by_node0(group: str, ranks: list[int]) -> int:
        before = nodes_lab.link_bytes()[0]
        nodes_lab.run(f"dist.all_reduce(torch.ones({size // 4}), group={group})", ranks=ranks, stream=False)
        return nodes_lab.link_bytes()[0] - before

    assert sent_by_node0("same_node", [0, 1]) < size / 8  # loopback inside node 0: only the control chatter
    assert sent_by_node0("across", [0, 2]) >= size  # a 2-rank ring: each rank sends the whole tensor once


def test_the_link_is_shaped_both_ways_and_reshaped_between_cells(nodes_lab):
    queues = nodes_lab.processes.network.queues()
    assert len(queues) == 4 and all("tbf" in q and "rate 1Gbit" in q for q in queues.values()), queues
    nodes_lab.run("across = dist.new_group([0, 2])", stream=False)
    new = nodes_lab.set_link("40mbit")
    assert nodes_lab.link == new and new.rate_bps == 40_000_000
    assert all("rate 40Mbit" in q for q in nodes_lab.processes.network.queues().values())
    size = 2 * 2**20
    took = nodes_lab.run(
        f"import time\nx = torch.ones({size // 4})\n"
        "dist.barrier(group=across)\n"
        "t0 = time.perf_counter(); dist.all_reduce(x, group=across); time.perf_counter() - t0",
        ranks=[0, 2], stream=False, timeout=60,
    )
    # No faster than the link allows (a bound the kernel sets, not a speed target): S / B.
    floor = size * 8 / 40e6
    assert min(took.values()) > 0.9 * floor, (took, floor)
    with pytest.raises(LabUsageError, match="bandwidth with a unit"):
        nodes_lab.set_link("fast")
    assert nodes_lab.link == new  # a bad value changes nothing
    nodes_lab.set_link(None)
    assert nodes_lab.link is None and not any("tbf" in q for q in nodes_lab.processes.network.queues().values())


def test_ddp_across_nodes_matches_single_process_training(nodes_lab):
    params = nodes_lab.run(TRAIN, stream=False)
    for rank in range(1, 4):
        assert all(torch.equal(a, b) for a, b in zip(params[0], params[rank])), f"rank {rank} differs"
    for got, want in zip(params[0], reference()):
        assert torch.allclose(got, want, atol=1e-6)


def test_output_streams_labelled_by_rank_and_identical_errors_are_grouped(nodes_lab, capsys):
    nodes_lab.run("import socket\nprint(f'hello from {socket.gethostname()}')")
    out = "\n".join(rank_lines(capsys.readouterr().out))  # ranks 0 and 1 say the same: one line
    for rank, node in ((0, "node0"), (1, "node0"), (2, "node1"), (3, "node1")):
        assert re.search(rf"\[rank {rank}\].*hello from {node}", out), out
    with pytest.raises(RankError) as info:
        nodes_lab.run("raise ValueError('bad shard')", stream=False)
    assert info.value.summary.count("ValueError: bad shard") == 1 and "ranks 0-3" in str(info.value)


def test_a_collective_some_ranks_never_reach_is_diagnosed_and_released_across_nodes(nodes_lab):
    pids = [r.pid for r in nodes_lab.status()]
    with pytest.raises(CellTimeout) as info:
        nodes_lab.run("if rank in (0, 2):\n    dist.all_reduce(torch.ones(6))\n", timeout=2, stream=False)
    text = str(info.value)
    assert re.search(r"rank 0,2 waited in it", text) and re.search(r"rank 1,3 never arrived", text), text
    assert [r.pid for r in nodes_lab.status()] == pids  # released, not killed
    assert dict(nodes_lab.run(ALL_REDUCE_ONE, stream=False)) == dict.fromkeys(range(4), 4.0)


def test_torchs_differentiable_collectives_use_the_group_rebuilt_after_a_release(nodes_lab):
    # torch.distributed.nn.functional takes the default group of the moment it is imported as its
    # functions' default; a cell imports it with torch.distributed.optim (FSDP and pipelining too).
    # These ranks are started afresh (no warm template on nodes), so nothing imported it earlier.
    nodes_lab.run("import torch.distributed.optim", stream=False)
    with pytest.raises(CellTimeout):
        nodes_lab.run("if rank in (0, 2):\n    dist.all_reduce(torch.ones(6))\n", timeout=2, stream=False)
    summed = nodes_lab.run("import torch.distributed.nn.functional as F\n"
                           "F.all_reduce(torch.ones(1, requires_grad=True)).item()", stream=False)
    assert dict(summed) == dict.fromkeys(range(4), 4.0)


def test_interrupting_the_notebook_stops_the_cell_on_every_node(nodes_lab):
    # A kernel interrupt is SIGINT to the notebook's process: ranks on node1 sleep in Python, those
    # on node0 wait in an all-reduce across the link that node1 never joins.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    pids = [r.pid for r in nodes_lab.status()]
    timer.start()
    try:
        with pytest.raises(RankError) as info:
            nodes_lab.run("import time\nif rank >= 2:\n    time.sleep(60)\nt = torch.ones(1)\ndist.all_reduce(t)",
                          stream=False)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, before)
    assert set(info.value.ranks) == {0, 1, 2, 3}
    assert [r.pid for r in nodes_lab.status()] == pids and all(r.health == "ok" for r in nodes_lab.status())
    assert dict(nodes_lab.run(ALL_REDUCE_ONE, stream=False)) == dict.fromkeys(range(4), 4.0)


def test_ranks_all_stuck_on_two_nodes_are_released_over_the_control_channel(nodes_lab):
    # No rank is free: each is freed by its own engine's control thread, on whichever node it runs.
    nodes_lab.run("kept = rank * 10", stream=False)
    pids = [r.pid for r in nodes_lab.status()]
    with pytest.raises(CellTimeout) as info:
        nodes_lab.run("if rank < 2:\n    dist.all_reduce(torch.ones(4))\nelse:\n    dist.broadcast(torch.ones(4), 2)\n",
                      timeout=2, stream=False)
    assert "the ranks disagree on what it is" in str(info.value)
    assert [r.pid for r in nodes_lab.status()] == pids
    assert dict(nodes_lab.run("kept", stream=False)) == {0: 0, 1: 10, 2: 20, 3: 30}
    assert dict(nodes_lab.run(ALL_REDUCE_ONE, stream=False)) == dict.fromkeys(range(4), 4.0)


def test_a_killed_rank_on_another_node_is_named_and_restart_brings_the_nodes_back(nodes_lab):
    subnet = nodes_lab.processes.network.subnet
    nodes_lab.kill(3)
    with pytest.raises(RankError) as info:
        nodes_lab.run(ALL_REDUCE_ONE, stream=False, timeout=20)
    assert "rank 3" in str(info.value)
    nodes_lab.restart()
    assert [r.host for r in nodes_lab.status()] == ["node0", "node0", "node1", "node1"]
    assert nodes_lab.processes.network.subnet == subnet  # the same network: only the engines were replaced
    assert dict(nodes_lab.run(ALL_REDUCE_ONE, stream=False)) == dict.fromkeys(range(4), 4.0)


def test_watch_publishes_every_ranks_all_reduces_across_nodes(nodes_lab):
    nodes_lab.run(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\n"
        "model = DDP(torch.nn.Linear(64, 64))\n"
        "distlab.watch(model)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); model(torch.randn(8, 64)).pow(2).mean().backward(); opt.step()\n",
        stream=False,
    )
    records = nodes_lab.telemetry.records()
    assert {r["rank"] for r in records} == {0, 1, 2, 3}
    assert all(r["allreduce"] for r in records)  # each step's buckets, timed on every rank


def test_checkpoint_and_resume_on_nodes_at_another_size(nodes_lab, tmp_path):
    nodes_lab.push(CKPT=str(tmp_path))
    nodes_lab.run(TRAIN_ONE_EPOCH, stream=False)
    saved = nodes_lab.run("(step, [p.detach().clone() for p in model.parameters()])", stream=False)
    nodes_lab.restart(ranks=2)  # one rank per node
    assert [r.host for r in nodes_lab.status()] == ["node0", "node1"]
    nodes_lab.push(CKPT=str(tmp_path))
    nodes_lab.run(TRAIN_ONE_EPOCH, stream=False)
    after = nodes_lab.run("(world_size, resumed, seen)", stream=False)
    for world, resumed, _ in after.values():
        assert world == 2 and all(torch.equal(a, b) for a, b in zip(resumed, saved[0][1]))
    shards = [set(after[r][2]) for r in range(2)]
    assert set().union(*shards) == set(range(24)) and sum(map(len, shards)) == 24


def test_the_side_panel_sees_the_ranks_on_their_nodes(nodes_lab):
    rows = registry.read_labs()
    mine = next(lab for lab in rows if lab["id"] == registry.id_of(nodes_lab))
    assert [(r["rank"], r["host"], r["addr"]) for r in mine["ranks"]] == [
        (r.rank, r.host, r.addr) for r in nodes_lab.table
    ]
    assert mine["link"] == LINK


def test_two_labs_at_once_get_disjoint_subnets_and_nothing_outlives_them():
    before = lab_namespaces()
    first = distlab.start(ranks=2, nodes=2, link="100mbit")
    try:
        second = distlab.start(ranks=2, nodes=2)
        try:
            nets = [first.processes.network.subnet, second.processes.network.subnet]
            assert not nets[0].overlaps(nets[1])
            made = lab_namespaces() - before
            assert len(made) == 6  # two switches, four nodes
            with pytest.raises(LabUsageError, match="overlaps"):
                distlab.start(ranks=2, nodes=2, subnet=str(nets[0]))
            assert lab_namespaces() - before == made  # the refused lab made nothing
            pids = [r.pid for r in first.table + second.table]
        finally:
            second.stop()
    finally:
        first.stop()
    assert lab_namespaces() == before
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


def test_latency_needs_netem_and_without_it_the_start_says_so_and_makes_nothing():
    before = lab_namespaces()
    if nodes_mod.netem_missing() is None:  # a kernel with netem: the delay is really there
        lab = distlab.start(ranks=2, nodes=2, link="1gbit", latency="10ms")
        try:
            assert all("netem" in q and "delay 5ms" in q for q in lab.processes.network.queues().values())
        finally:
            lab.stop()
    else:
        with pytest.raises(LabUsageError) as info:
            distlab.start(ranks=2, nodes=2, link="1gbit", latency="200us")
        assert "netem" in str(info.value) and "\n" not in str(info.value)
    assert lab_namespaces() == before


def test_an_orphaned_labs_namespaces_are_removed_by_the_next_lab():
    # A notebook that died with its reaper (both SIGKILLed) leaves namespaces; the next start removes them.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = f"distlab-{dead.pid}-1-n0"
    subprocess.run(["ip", "netns", "add", orphan], check=True, timeout=10)
    try:
        assert orphan in nodes_mod.remove_orphans()
        assert orphan not in lab_namespaces(dead.pid)
    finally:
        subprocess.run(["ip", "netns", "del", orphan], capture_output=True, timeout=10, check=False)
