"""distlab.rank.torchcompat: the torch versions distlab accepts, and the private torch calls it wraps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _single_rank import single_rank_group
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.rank import torchcompat, torchcompat_c10d, torchcompat_torchft


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1", "2.13.0+cpu", "2.11.0a0+git1234abc"])
def test_the_torch_versions_really_run_are_accepted(version):
    assert torchcompat.torch_version_problem(version) is None
    torchcompat.check_torch(version, {})


def test_the_torch_this_machine_runs_is_accepted():
    assert torchcompat.torch_version_problem(torch.__version__) is None


@pytest.mark.parametrize("version", ["2.4.1", "2.10.0", "2.14.0", "3.0.0", "nightly"])
def test_another_torch_is_refused_in_one_line_that_says_what_to_do(version):
    with pytest.raises(ImportError) as exc:
        torchcompat.check_torch(version, {})
    message = str(exc.value)
    assert "\n" not in message
    assert f"this is torch {version}" in message
    assert "torch 2.11 to 2.13" in message
    assert "pip install torch==2.13.0" in message
    assert "DISTLAB_ALLOW_ANY_TORCH=1" in message


def test_another_torch_is_tried_with_a_warning_when_the_user_allows_it():
    with pytest.warns(RuntimeWarning, match="this is torch 2.4.1"):
        torchcompat.check_torch("2.4.1", {"DISTLAB_ALLOW_ANY_TORCH": "1"})


def test_a_ddp_models_communication_hooks_are_named():
    with single_rank_group():
        model = DDP(torch.nn.Linear(4, 2))
        assert torchcompat.comm_hook_names(model) == []
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        assert torchcompat.comm_hook_names(model) == ["allreduce_hook"]
        assert torchcompat.swappable_reducer(model)


def test_the_flight_recorder_shows_the_collectives_just_made():
    with single_rank_group():
        dist.all_reduce(torch.ones(3))
        dump = torchcompat.flight_recorder_dump()
    assert dump is not None
    ours = [e for e in dump["entries"] if e["process_group"][1] == "default_pg"]
    assert ours and ours[-1]["profiling_name"].endswith("all_reduce")
    assert ours[-1]["input_sizes"] == [[3]]


def test_forgotten_process_groups_leave_a_process_that_can_make_a_new_group():
    with single_rank_group():
        torchcompat.forget_process_groups()  # as after a destroy_process_group that raised half-way
        assert not dist.is_initialized()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]


def test_in_place_changes_and_only_those_advance_the_version_counter():
    w = torch.zeros(3)
    before = torchcompat.version_counter(w)
    _ = w + 1
    assert torchcompat.version_counter(w) == before
    w.add_(1)
    assert torchcompat.version_counter(w) == before + 1


def test_the_batched_tensor_operations_equal_their_one_by_one_versions():
    a, b = [torch.randn(5), torch.randn(2, 3)], [torch.randn(5), torch.randn(2, 3)]
    norms = torchcompat.foreach_norm(a)
    assert [n.item() for n in norms] == pytest.approx([torch.linalg.vector_norm(t).item() for t in a])
    expected = [x - y for x, y in zip(a, b)]
    torchcompat.foreach_sub_(a, b)
    assert all(torch.equal(x, e) for x, e in zip(a, expected))
    torchcompat.foreach_copy_(a, b)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_point_to_point_functions_are_replaced_where_torch_looks_them_up_and_restored_after():
    c10d = dist.distributed_c10d
    theirs = torchcompat_c10d.point_to_point_functions(("isend", "irecv"))
    assert theirs == {"isend": dist.isend, "irecv": dist.irecv}

    def isend(*args, **kwargs):
        return theirs["isend"](*args, **kwargs)

    with torchcompat_c10d.replaced_point_to_point({"isend": isend}):
        assert dist.isend is isend and c10d.isend is isend
        assert dist.irecv is theirs["irecv"]  # only what was named
    assert dist.isend is theirs["isend"] and c10d.isend is theirs["isend"]


def test_point_to_point_functions_are_restored_when_the_block_raises():
    before = dist.send
    with pytest.raises(KeyError), torchcompat_c10d.replaced_point_to_point({"send": print}):
        raise KeyError("the grader's own failure")
    assert dist.send is before and dist.distributed_c10d.send is before


@pytest.mark.parametrize("version", ["0.1.1", "0.2.1", "0.3.0"])
def test_another_torchft_is_refused_in_one_line_that_says_what_to_install(version):
    problem = torchcompat_torchft.torchft_version_problem(version)
    assert problem is not None and "\n" not in problem
    assert f"this is torchft {version}" in problem and "pip install torchft==0.2.0" in problem


def test_the_torchft_healing_is_run_with_is_accepted_and_its_ddp_made():
    pytest.importorskip("torchft")
    assert torchcompat_torchft.torchft_version_problem("0.2.0") is None
    healing = torchcompat_torchft.healing_ddp_class(print)
    from torchft.ddp import DistributedDataParallel

    assert issubclass(healing, DistributedDataParallel) and "_comm_hook" in vars(healing)


@pytest.mark.cluster
def test_the_lighthouse_is_started_from_torchfts_compiled_module_alone_without_torch(tmp_path):
    pytest.importorskip("torchft")
    from distlab.cluster import torchftcompat_lighthouse
    from distlab.cluster.lighthouse import Lighthouse

    assert torchftcompat_lighthouse.KNOWN_GOOD_TORCHFT == torchcompat_torchft.KNOWN_GOOD_TORCHFT
    lighthouse = Lighthouse.start("127.0.0.1", str(tmp_path))
    try:
        with open(f"/proc/{lighthouse.pid}/maps") as f:
            mapped = f.read()
        assert "_torchft" in mapped and "libtorch" not in mapped, "torchft's server, without torch loaded"
        assert lighthouse.address.startswith("http://127.0.0.1:")
    finally:
        lighthouse.stop()


def test_a_forwarding_work_says_what_the_work_it_stands_for_says():
    with single_rank_group():
        work = dist.barrier(async_op=True)
        forwarding = torchcompat_c10d.ForwardingWork(work)
        assert forwarding.wait() is True
        assert forwarding.is_completed() and forwarding.is_success()
