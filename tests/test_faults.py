"""Faults on real ranks: a rank dies, a collective is never reached, ranks disagree; named, released, recovered."""

from __future__ import annotations

import re
import time

import pytest
import torch

from distlab import CellTimeout, RankError
from distlab.errors import ABSENT, FAILED, FINISHED, STUCK, diagnose_collectives

ALL_REDUCE_ONE = "t = torch.ones(1); dist.all_reduce(t); t.item()"

# The victim dies 0.3 s into the cell: while the others wait for it in an all-reduce, or while
# every rank is busy in Python (not in a collective).
DEATHS = {
    "SIGKILL while the others wait in an all-reduce": (
        "import os, signal, time\n"
        "if rank == VICTIM:\n"
        "    time.sleep(0.3)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
    ),
    "os._exit while every rank computes": (
        "import os, time\n"
        "time.sleep(0.3)\n"
        "if rank == VICTIM:\n"
        "    os._exit(3)\n"
        "time.sleep(30)\n"
    ),
}


def _kill_every_rank_in_turn(lab, rounds: int, every_way: bool = True) -> list[float]:
    """Each victim ``rounds`` times, each way of dying (or the ways in turn): checks every outcome."""
    delays = []
    ways = list(DEATHS.items())
    for round_ in range(rounds):
        for victim in range(lab.world_size):
            for how, code in ways if every_way else [ways[(victim + round_) % len(ways)]]:
                t0 = time.monotonic()
                with pytest.raises(RankError) as info:
                    lab.run(code.replace("VICTIM", str(victim)), stream=False)
                delay = time.monotonic() - t0 - 0.3
                delays.append(delay)
                failures = info.value.failures
                assert failures[victim].ename == "EngineError", (how, victim, str(info.value))
                survivors = [r for r in range(lab.world_size) if r != victim]
                for r in survivors:
                    assert failures[r].ename == "Stopped", (how, victim, str(info.value))
                    assert f"rank {victim} died" in failures[r].evalue
                # Generous: survivors left to wait out the collective timeout would take lab.timeout.
                # How fast a death is named is measured in benchmarks/bench_faults.py.
                assert delay < lab.timeout / 2, f"{how}, victim {victim}: the survivors waited {delay:.2f} s"
                health = [row.health for row in lab.status()]
                assert health == ["dead" if r == victim else "ok" for r in range(lab.world_size)]
                lab.restart()
                summed = dict(lab.run(ALL_REDUCE_ONE, stream=False))
                assert summed == dict.fromkeys(range(lab.world_size), float(lab.world_size))
    return delays


@pytest.mark.cluster
def test_any_rank_dying_mid_cell_fails_the_cell_naming_it_without_waiting_out_the_timeout_at_two_ranks(lab_factory):
    _kill_every_rank_in_turn(lab_factory(ranks=2), rounds=1)


@pytest.mark.cluster
def test_any_rank_dying_mid_cell_fails_the_cell_naming_it_without_waiting_out_the_timeout_at_four_ranks(lab_factory):
    _kill_every_rank_in_turn(lab_factory(ranks=4, timeout=60), rounds=1, every_way=False)


@pytest.mark.cluster
def test_a_collective_some_ranks_never_reach_names_them_and_where_the_others_wait(lab):
    code = (
        "t = torch.ones(3, 5)\n"
        "dist.all_reduce(t)\n"
        "if rank == 0:\n"
        "    dist.all_reduce(torch.ones(7))\n"
    )
    t0 = time.monotonic()
    with pytest.raises(CellTimeout) as info:
        lab.run(code, timeout=2, stream=False)
    assert time.monotonic() - t0 < lab.timeout / 2  # ended near its deadline, not at the group's timeout
    text = str(info.value)
    waited = re.search(r"collective #(\d+) \(all_reduce of \[7\] float32\): rank 0 waited in it", text)
    missing = re.search(r"rank 1 never arrived \(its last was #(\d+), all_reduce of \[3, 5\] float32", text)
    assert waited and missing, text
    assert int(waited.group(1)) == int(missing.group(1)) + 1
    assert "process group rebuilt" in text
    assert dict(lab.run(ALL_REDUCE_ONE, stream=False)) == {0: 2.0, 1: 2.0}


@pytest.mark.cluster
def test_a_collective_that_outlives_the_groups_own_timeout_is_diagnosed_as_a_cell_deadline_is(lab_factory):
    # No cell deadline: the process group's timeout fires first, and gloo's own message says only
    # that it timed out. The diagnosis still names who never arrived and where the other waited.
    lab = lab_factory(ranks=2, timeout=4)
    with pytest.raises(RankError) as info:
        lab.run("if rank == 0:\n    dist.all_reduce(torch.ones(7))\n", stream=False)
    text = str(info.value)
    assert "Timed out waiting" in text  # gloo's words, kept
    assert re.search(r"collective #\d+ \(all_reduce of \[7\] float32\): rank 0 waited in it", text), text
    assert "rank 1 never arrived" in text, text
    assert dict(lab.run(ALL_REDUCE_ONE, stream=False)) == {0: 2.0, 1: 2.0}


@pytest.mark.cluster
def test_ranks_stuck_in_different_collectives_are_all_released_with_their_namespaces(lab):
    # No rank is free to tear the group down from outside: each stuck rank drops its own connections.
    lab.run("kept = rank * 10", stream=False)
    pids = [row.pid for row in lab.status()]
    t0 = time.monotonic()
    with pytest.raises(CellTimeout) as info:
        lab.run("if rank == 0:\n    dist.all_reduce(torch.ones(4))\nelse:\n    dist.broadcast(torch.ones(4), 1)\n",
                timeout=2, stream=False)
    assert time.monotonic() - t0 < lab.timeout / 2  # ended near its deadline, not at the group's timeout
    assert (
        "the ranks disagree on what it is (rank 0 all_reduce of [4] float32, rank 1 broadcast of [4] float32)"
        in str(info.value)
    )
    assert [row.pid for row in lab.status()] == pids  # released, not killed
    assert dict(lab.run("kept", stream=False)) == {0: 0, 1: 10}
    assert dict(lab.run(ALL_REDUCE_ONE, stream=False)) == {0: 2.0, 1: 2.0}


@pytest.mark.cluster
def test_a_collective_on_a_subset_of_ranks_names_the_ranks_not_in_the_cell(lab):
    with pytest.raises(CellTimeout) as info:
        lab.run("dist.barrier()", ranks=[0], timeout=1.5, stream=False)
    assert "rank 1 never arrived" in str(info.value) and ABSENT in str(info.value)
    assert dict(lab.run(ALL_REDUCE_ONE, stream=False)) == {0: 2.0, 1: 2.0}


@pytest.mark.cluster
def test_with_debug_a_shape_mismatch_is_named_on_every_rank_by_the_rank_itself(lab_factory):
    # 60 s: a fresh-clone CI run's start timed out at 30 s describing the engines, beside 4-rank labs.
    lab = lab_factory(ranks=2, debug=True, timeout=60)
    assert lab.run("dist.get_debug_level() == dist.DebugLevel.DETAIL", stream=False) == {0: True, 1: True}
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        lab.run("t = torch.ones(rank + 1)\ndist.all_reduce(t)", stream=False)
    elapsed = time.monotonic() - t0
    assert elapsed < lab.timeout / 2, f"{elapsed:.2f} s: a rank waited out the timeout instead of failing at once"
    for rank in (0, 1):
        failure = info.value.failures[rank]
        assert failure.ename != "Stopped", str(info.value)  # each rank found it itself
        assert "mismatch" in failure.evalue.lower()
        assert "TensorShape=[1]" in failure.evalue and "TensorShape=[2]" in failure.evalue
    assert dict(lab.run(ALL_REDUCE_ONE, stream=False)) == {0: 2.0, 1: 2.0}


def test_restart_with_a_new_size_and_bad_sizes(lab_factory):
    lab = lab_factory(ranks=2)
    lab.restart(ranks=3)
    assert lab.world_size == 3 and [row.rank for row in lab.status()] == [0, 1, 2]
    assert dict(lab.run(ALL_REDUCE_ONE, stream=False)) == {0: 3.0, 1: 3.0, 2: 3.0}
    pids = [row.pid for row in lab.status()]
    for bad in (0, -1, "two", 1.5):
        with pytest.raises(ValueError, match="ranks must be"):
            lab.restart(ranks=bad)
    assert [row.pid for row in lab.status()] == pids  # bad input changed nothing


def _p2p(op, seq, peer, pending=False):
    return {"seq": seq, "op": op, "shapes": [[2, 3]], "dtypes": ["float32"], "p2p": True, "group": "0",
            "desc": "default_pg", "members": [0, 1], "peer": peer, "pending": pending}


@pytest.mark.parametrize(
    "traces, doing, expected",
    [
        # Everyone at the same, matching collective: nothing to say (the hang is elsewhere).
        ({0: [{"seq": 4, "op": "all_reduce", "shapes": [[2]], "dtypes": ["Float"]}],
          1: [{"seq": 4, "op": "all_reduce", "shapes": [[2]], "dtypes": ["Float"]}]}, {0: STUCK, 1: STUCK}, None),
        # No collective at all yet.
        ({0: [], 1: []}, {0: STUCK, 1: FINISHED}, None),
        # Two ranks ahead, two behind for different reasons.
        ({0: [{"seq": 2, "op": "barrier", "shapes": [], "dtypes": []}],
          1: [{"seq": 2, "op": "barrier", "shapes": [], "dtypes": []}],
          2: [{"seq": 1, "op": "broadcast", "shapes": [[3]], "dtypes": ["Long"]}],
          3: []},
         {0: STUCK, 1: STUCK, 2: FAILED, 3: ABSENT},
         "collective #2 (barrier): rank 0-1 waited in it; "
         "rank 2 never arrived (its last was #1, broadcast of [3] int64; its cell failed); "
         "rank 3 never arrived (it had made no collective; not in this cell)"),
        # A hang in a sub-group (a mesh dimension): named, among its own members only. The default
        # group agrees, and ranks 2-3's own tp group finished its collective.
        ({r: [{"seq": 3, "op": "barrier", "shapes": [], "dtypes": [], "group": "0", "desc": "default_pg",
               "members": [0, 1, 2, 3]},
              *([{"seq": 1, "op": "all_reduce", "shapes": [[4]], "dtypes": ["Float"], "group": "2",
                  "desc": "mesh_tp", "members": [0, 1]}] if r == 0 else []),
              *([{"seq": 1, "op": "all_reduce", "shapes": [[4]], "dtypes": ["Float"], "group": "3",
                  "desc": "mesh_tp", "members": [2, 3]}] if r > 1 else [])]
          for r in range(4)},
         {0: STUCK, 1: FINISHED, 2: FINISHED, 3: FINISHED},
         "collective #1 in group mesh_tp of ranks 0-1 (all_reduce of [4] float32): rank 0 waited in it; "
         "rank 1 never arrived (it had made no collective; its cell had finished)"),
        # A rank whose group was torn down to release it reads no members: another rank's are used.
        ({r: [{"seq": 7 if r == 0 else 6, "op": "all_gather" if r == 0 else "all_reduce", "shapes": [[8]],
               "dtypes": ["Float"], "group": "1", "desc": "mesh_dp", "members": [0, 2] if r == 2 else []}]
          for r in (0, 2)} | {1: [], 3: []},
         {0: STUCK, 1: FINISHED, 2: FINISHED, 3: FINISHED},
         "collective #7 in group mesh_dp of ranks 0,2 (all_gather of [8] float32): rank 0 waited in it; "
         "rank 2 never arrived (its last was #6, all_reduce of [8] float32; its cell had finished)"),
        # Point-to-point operations are numbered apart and do not count as collectives.
        ({0: [{"seq": 1, "op": "all_reduce", "shapes": [[1]], "dtypes": ["Float"]},
              {"seq": 1, "op": "send", "shapes": [[1]], "dtypes": ["Float"], "p2p": True}],
          1: [{"seq": 1, "op": "all_reduce", "shapes": [[1]], "dtypes": ["Float"]}]}, {0: STUCK, 1: STUCK}, None),
        # A receive its peer never sent: the n-th receive from a peer is matched by its n-th send.
        ({0: [_p2p("recv", 2, peer=1, pending=True)], 1: [_p2p("send", 1, peer=0)]},
         {0: STUCK, 1: FINISHED},
         "recv #2 from rank 1 (recv of [2, 3] float32): rank 0 waited in it; "
         "rank 1 never sent it (it had posted 1 send to rank 0; its cell had finished)"),
        # Two ranks that each send to the other first: one line, the cycle.
        ({0: [_p2p("send", 1, peer=1, pending=True)], 1: [_p2p("send", 1, peer=0, pending=True)]},
         {0: STUCK, 1: STUCK},
         "ranks 0 and 1 each wait in a send to the other (send of [2, 3] float32), and neither has posted the "
         "matching recv: a deadlock. Post the recv first on one of them, or both together with "
         "dist.batch_isend_irecv"),
        # Matched sends and receives, one of them from any source: nothing to say of them.
        ({0: [_p2p("send", 2, peer=1, pending=True)],
          1: [_p2p("recv", 1, peer=0), _p2p("recv", 1, peer=-1)]}, {0: STUCK, 1: STUCK}, None),
        # A send to a rank that died: its record was not read.
        ({0: [_p2p("send", 1, peer=1, pending=True)]}, {0: STUCK, 1: ABSENT},
         "send #1 to rank 1 (send of [2, 3] float32): rank 0 waited in it; "
         "rank 1 never posted the matching recv (its record could not be read; not in this cell)"),
    ],
)
def test_collective_diagnosis(traces, doing, expected):
    assert diagnose_collectives(traces, doing) == expected


TRAIN_ONE_EPOCH = """
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
from distlab import checkpoint

torch.manual_seed(0)
data = torch.linspace(-1, 1, 24).reshape(24, 1)
sampler = DistributedSampler(range(24), shuffle=True, seed=3)
model = DDP(torch.nn.Linear(1, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
last = checkpoint.latest(CKPT)
state = checkpoint.load(last, model=model, optimizer=opt, sampler=sampler) if last else {"step": 0, "epoch": -1}
step, epoch = state["step"], state["epoch"] + 1
resumed = [p.detach().clone() for p in model.parameters()]
sampler.set_epoch(epoch)
seen = list(sampler)
for i in seen:
    opt.zero_grad()
    model(data[i : i + 1]).sub(3 * data[i : i + 1]).pow(2).mean().backward()
    opt.step()
    step += 1
checkpoint.save(checkpoint.path_for(CKPT, step), model=model, optimizer=opt, step=step, sampler=sampler)
"""


@pytest.mark.cluster
def test_restart_at_a_new_size_continues_from_the_last_checkpoint_with_the_data_resharded(lab_factory, tmp_path):
    lab = lab_factory(ranks=2)
    lab.push(CKPT=str(tmp_path))
    lab.run(TRAIN_ONE_EPOCH, stream=False)
    saved = lab.run("(step, [p.detach().clone() for p in model.parameters()])", stream=False)
    assert saved[0][0] == saved[1][0] == 12  # 24 samples over 2 ranks, one step each
    lab.restart(ranks=3)
    lab.push(CKPT=str(tmp_path))
    lab.run(TRAIN_ONE_EPOCH, stream=False)
    after = lab.run("(world_size, epoch, resumed, seen, step)", stream=False)
    for world, epoch, resumed, _seen, step in after.values():
        assert (world, epoch) == (3, 1)
        assert all(torch.equal(a, b) for a, b in zip(resumed, saved[0][1]))  # weights of the last checkpoint
        assert step == 12 + 8  # 24 samples over 3 ranks
    shards = [set(after[r][3]) for r in range(3)]
    assert set().union(*shards) == set(range(24)) and sum(map(len, shards)) == 24  # re-sharded: disjoint, complete
