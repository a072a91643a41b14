"""The rank table and backend choice, from what engines say of themselves: no process started."""

from __future__ import annotations

import shutil

import pytest

from distlab.errors import LabUsageError
from distlab.notebook.config import LabConfig
from distlab.notebook.world import check_gpus, plan_world


def identity(host: str, pid: int, gpus: int = 0, launcher_rank: int | None = None, addr: str = "10.0.0.1") -> dict:
    return {"host": host, "pid": pid, "addr": addr, "cuda_devices": gpus, "launcher_rank": launcher_rank,
            "python": "3.11", "torch": "2.13.0"}


def test_ranks_are_grouped_by_host_in_order_of_each_hosts_first_engine():
    world = plan_world(
        {3: identity("b", 13), 1: identity("a", 11), 2: identity("b", 12), 4: identity("a", 14)}, 4, "auto"
    )
    assert [(r.rank, r.engine_id, r.host, r.local_rank) for r in world.table] == [
        (0, 1, "a", 0), (1, 4, "a", 1), (2, 2, "b", 0), (3, 3, "b", 1)
    ]


def test_a_launchers_numbering_is_kept_when_every_engine_has_one():
    world = plan_world({0: identity("a", 10, launcher_rank=1), 1: identity("a", 11, launcher_rank=0)}, 2, "gloo")
    assert [r.engine_id for r in world.table] == [1, 0]


def test_a_partial_launcher_numbering_is_ignored():
    world = plan_world({0: identity("a", 10, launcher_rank=1), 1: identity("a", 11)}, 2, "gloo")
    assert [r.engine_id for r in world.table] == [0, 1]


def test_auto_picks_nccl_only_when_every_rank_has_a_gpu():
    assert plan_world({0: identity("a", 1, gpus=2), 1: identity("a", 2, gpus=2)}, 2, "auto").backend == "nccl"
    assert plan_world({0: identity("a", 1, gpus=2), 1: identity("b", 2, gpus=0)}, 2, "auto").backend == "gloo"


def test_nccl_ranks_get_the_gpu_of_their_local_rank():
    world = plan_world({0: identity("a", 1, gpus=2), 1: identity("a", 2, gpus=2)}, 2, "nccl")
    assert [r.device for r in world.table] == ["cuda:0", "cuda:1"]
    assert {r.backend for r in world.table} == {"nccl"}


def test_nccl_on_a_host_without_gpus_names_the_host_and_the_fix():
    with pytest.raises(LabUsageError, match=r"b has none: use --backend gloo"):
        plan_world({0: identity("a", 1, gpus=1), 1: identity("b", 2, gpus=0)}, 2, "nccl")


def test_more_nccl_ranks_than_a_hosts_gpus_are_refused():
    with pytest.raises(LabUsageError, match="host a has 1 GPUs but 2 ranks"):
        plan_world({0: identity("a", 1, gpus=1), 1: identity("a", 2, gpus=1)}, 2, "nccl")


def test_one_host_rendezvous_on_loopback_and_several_at_rank_0s_address():
    one = plan_world({0: identity("a", 1, addr="10.0.0.5"), 1: identity("a", 2, addr="10.0.0.5")}, 2, "gloo")
    assert one.master_addr == "127.0.0.1"
    two = plan_world({0: identity("a", 1, addr="10.0.0.5"), 1: identity("b", 2, addr="10.0.0.6")}, 2, "gloo")
    assert two.master_addr == "10.0.0.5"
    assert two.local_world_size("a") == 1 and one.local_world_size("a") == 2


def test_cpu_ranks_need_no_gpu_check_and_gpu_requests_beyond_the_machine_are_refused():
    check_gpus(4, "gloo", 0)
    with pytest.raises(LabUsageError, match="has none"):
        check_gpus(1, "nccl", 0)
    with pytest.raises(LabUsageError, match="start at most -n 2"):
        check_gpus(3, "nccl", 2)
    check_gpus(3, "nccl", None)  # not known before the ranks start: plan_world decides


def test_the_gpu_count_is_read_from_the_driver_as_cuda_narrows_it(tmp_path):
    from distlab.cluster.gpus import local_gpus, visible

    proc = tmp_path / "gpus"
    for bus in ("0000:17:00.0", "0000:65:00.0", "0000:ca:00.0", "0000:e3:00.0"):
        (proc / bus).mkdir(parents=True)
    absent = tmp_path / "absent"
    assert local_gpus(proc, {}, absent) == 4
    assert local_gpus(proc, {"CUDA_VISIBLE_DEVICES": "2,3"}, absent) == 2
    assert local_gpus(proc, {"CUDA_VISIBLE_DEVICES": ""}, absent) == 0
    if shutil.which("nvidia-smi") is None:  # nothing from NVIDIA's driver at all
        assert local_gpus(absent, {}, absent) == 0  # a machine without GPUs
        assert local_gpus(absent, {}, tmp_path) is None  # ROCm's /dev/kfd: the ranks decide
    # CUDA_VISIBLE_DEVICES as torch reads it: up to a negative or absent index; a repeat hides all.
    cases = {"0": 1, "1,0": 2, "0,-1,1": 1, "0,7,1": 1, "1gpu,2": 2, "0,0": 0, "-1": 0, "GPU-a,GPU-b": 2,
             "GPU-a,GPU-a": 0, "GPU-a,3": 1, "MIG-x": 1, "a": 0}
    assert {mask: visible(4, mask) for mask in cases} == cases


@pytest.mark.parametrize(
    "values, fragment",
    [
        ({"ranks": 0}, "-n must be >= 1"),
        ({"ranks": "two"}, "-n must be a whole number"),
        ({"timeout": 0}, "--timeout must be a number of seconds > 0"),
        ({"timeout": "soon"}, "--timeout must be a number of seconds"),
        ({"backend": "mpi-ish"}, "unknown backend 'mpi-ish'"),
        ({"launcher": "carrier-pigeon"}, "unknown launcher 'carrier-pigeon'"),
    ],
)
def test_the_magics_config_names_the_flag_the_user_typed(values, fragment):
    with pytest.raises(LabUsageError) as info:
        LabConfig(**values, spelling="magic")
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_config_is_normalised_once():
    config = LabConfig(ranks=3, timeout=5, launcher="LOCAL")
    assert (config.ranks, config.timeout, config.launcher, config.local) == (3, 5.0, "local", True)
    assert isinstance(config.timeout, float)


def test_a_labs_own_nodes_come_first_in_order_whichever_engine_registered_first():
    ids = {0: identity("node1", 20, addr="198.18.0.2"), 1: identity("node0", 10, addr="198.18.0.1"),
           2: identity("node1", 21, addr="198.18.0.2"), 3: identity("node0", 11, addr="198.18.0.1")}
    world = plan_world(ids, 4, "gloo", host_order=["node0", "node1"])
    assert [(r.rank, r.host, r.local_rank) for r in world.table] == [
        (0, "node0", 0), (1, "node0", 1), (2, "node1", 0), (3, "node1", 1)
    ]
    assert world.master_addr == "198.18.0.1"  # node 0's address, as the other node reaches it
    assert plan_world(ids, 4, "gloo").table[0].host == "node1"  # without an order: first to register


def test_ranks_on_emulated_nodes_of_one_machine_share_its_cores_together():
    ids = {
        i: dict(identity(f"node{i // 2}", 10 + i, addr=f"198.18.0.{i // 2 + 1}"), machine="boot-a") for i in range(4)
    }
    world = plan_world(ids, 4, "gloo", host_order=["node0", "node1"])
    assert [world.local_world_size(r.host) for r in world.table] == [2, 2, 2, 2]  # local_rank counts per node
    assert [world.sharing_cores(r) for r in world.table] == [4, 4, 4, 4]  # threads split over the machine


def test_auto_with_fewer_gpus_than_ranks_runs_gloo_on_the_gpus_in_turn_and_says_so():
    world = plan_world({i: identity("a", 10 + i, gpus=1) for i in range(2)}, 2, "auto")
    assert world.backend == "gloo"
    assert [r.device for r in world.table] == ["cuda:0", "cuda:0"]
    assert world.note.startswith("this machine has 1 GPU for 2 ranks: they run gloo and take the GPU in turn")
    assert "through host memory" in world.note and "\n" not in world.note
    three = plan_world({i: identity("a", 10 + i, gpus=2) for i in range(3)}, 3, "auto")
    assert (three.backend, [r.device for r in three.table]) == ("gloo", ["cuda:0", "cuda:1", "cuda:0"])
    assert "2 GPUs for 3 ranks" in three.note


def test_auto_with_a_gpu_per_rank_is_nccl_and_says_nothing_more():
    world = plan_world({i: identity("a", 10 + i, gpus=4) for i in range(2)}, 2, "auto")
    assert (world.backend, [r.device for r in world.table], world.note) == ("nccl", ["cuda:0", "cuda:1"], "")


def test_gloo_asked_for_keeps_cpu_ranks_and_a_host_without_gpus_stays_on_cpu():
    world = plan_world({i: identity("a", 10 + i, gpus=1) for i in range(2)}, 2, "gloo")
    assert [r.device for r in world.table] == ["cpu", "cpu"] and world.note == ""
    mixed = plan_world({0: identity("a", 10, gpus=1), 1: identity("b", 11, gpus=0)}, 2, "auto")
    assert mixed.backend == "gloo" and [r.device for r in mixed.table] == ["cuda:0", "cpu"]
    assert mixed.note.startswith("b has no GPU: the ranks run gloo, on the GPUs of the hosts that have them")
    cpu = plan_world({i: identity("a", 10 + i) for i in range(2)}, 2, "auto")
    assert [r.device for r in cpu.table] == ["cpu", "cpu"] and cpu.note == ""


def test_emulated_nodes_on_one_machine_share_its_gpus_and_are_counted_together():
    def nodes(gpus: int) -> dict:
        return {i: {**identity(f"node{i}", 10 + i, gpus=gpus, addr=f"10.9.0.{i + 1}"), "machine": "boot-a"}
                for i in range(4)}

    # One GPU for four one-rank nodes: NCCL would put four ranks on it (it refuses), so auto shares it.
    shared = plan_world(nodes(1), 4, "auto", host_order=[f"node{i}" for i in range(4)])
    assert (shared.backend, [r.device for r in shared.table]) == ("gloo", ["cuda:0"] * 4)
    assert [r.local_rank for r in shared.table] == [0, 0, 0, 0]  # torchrun's local rank is per node
    assert shared.note.startswith("this machine has 1 GPU for 4 ranks")
    with pytest.raises(LabUsageError, match="has 1 GPUs but 4 ranks"):
        plan_world(nodes(1), 4, "nccl")
    # Four GPUs: a GPU each, told apart by the machine, not by each node's local rank (all 0).
    own = plan_world(nodes(4), 4, "auto", host_order=[f"node{i}" for i in range(4)])
    assert (own.backend, [r.device for r in own.table]) == ("nccl", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
