"""``distlab.chaos``: faults on a schedule inside a cell, counted in optimizer steps, on real ranks."""

from __future__ import annotations

import textwrap

import pytest

from distlab import RankError
from distlab.errors import CellTimeout

pytestmark = pytest.mark.cluster

# Plain DDP on the lab's group: the steps are the optimizer's own.
PLAIN = textwrap.dedent(
    """
    import time
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    SCHEDULE
    nans, times = [], []
    for step in range(6):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(torch.ones(3, 4)).square().sum().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        nans.append(any(bool(p.isnan().any()) for p in model.parameters()))
    """
)


def test_nan_and_slow_act_on_the_scheduled_rank_at_the_scheduled_step(lab):
    out = lab.run(PLAIN.replace("SCHEDULE", "distlab.chaos(nan={0: 3}, slow={1: 0.05})"), stream=False)
    assert "[chaos] rank 0: gradients set to NaN at step 3" in out.stdout[0]
    nans = lab.run("nans", stream=False)
    # Rank 0's update at step 3 is NaN (its gradients were made NaN after the average); at step 4 its
    # loss is NaN, DDP averages NaN gradients into rank 1's, and rank 1 is NaN too.
    assert nans[0] == [False, False, True, True, True, True]
    assert nans[1] == [False, False, False, True, True, True]
    # Rank 1 sleeps before each step (a straggler): at least that long, whatever the machine's load.
    assert min(lab.run("times", stream=False)[1]) >= 0.05
    # The schedule ended with its cell: the next cell's steps are plain.
    again = lab.run(PLAIN.replace("SCHEDULE", ""), stream=False)
    assert "[chaos]" not in again.stdout[0] + again.stdout[1]
    assert lab.run("nans", stream=False)[0] == [False] * 6


# A healing cell of 300 steps of ~35 ms: long enough for a replacement to heal from a live peer.
HEALING = textwrap.dedent(
    """
    import time
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    model, opt = distlab.heal(net, torch.optim.SGD(net.parameters(), lr=0.01))
    SCHEDULE
    for step in range(300):
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        time.sleep(0.03)
    """
)


def test_kill_in_a_lab_that_heals_kills_once_and_the_replacement_goes_on(lab_factory):
    lab = lab_factory(ranks=2, heal=True)
    out = lab.run(HEALING.replace("SCHEDULE", "distlab.chaos(kill={1: 10})"), stream=False)
    assert any("healed from a live peer" in note for note in out.notes), out.notes
    # The replacement healed past step 10: it was not killed again (its output is the new process's).
    assert "[chaos]" not in out.stdout[1]
    weights = lab.run("[p.detach().tolist() for p in net.parameters()]", stream=False)
    assert weights[0] == weights[1]


def test_two_ranks_killed_at_once_both_heal_and_a_stalled_rank_is_dropped_then_heals_forward(lab_factory):
    lab = lab_factory(ranks=4, heal=True)
    out = lab.run(HEALING.replace("SCHEDULE", "distlab.chaos(kill={1: 10, 2: 10})"), stream=False)
    # Each replacement healed past step 10 and was not killed again (its output is the new process's).
    assert not any("[chaos]" in out.stdout[r] for r in (1, 2)), out.stdout
    (note,) = [n for n in out.notes if "died" in n]
    assert note.startswith("ranks 1-2 died; their replacements ran the cell") and "the replicas are identical" in note
    record = lab.heals()
    assert record is not None
    assert sorted(h.rank for h in record.heals if h.replacement) == [1, 2], record.text()
    weights = lab.run("[p.detach().tolist() for p in net.parameters()]", stream=False)
    assert all(weights[r] == weights[0] for r in range(4))
    total = lab.run("t = torch.ones(1); dist.all_reduce(t); int(t.item())", stream=False)
    assert total == dict.fromkeys(range(4), 4), "the next cell has the whole world's group again"
    # A rank that stops past the lighthouse's join timeout (10 s) is dropped from the others' quorums,
    # not waited for: they go on; it comes back, heals forward to their step, and ends where they end
    # (its loop, counted from zero, would run on alone), with the lines after its loop run too.
    out = lab.run(HEALING.replace("SCHEDULE", "distlab.chaos(stall={3: (10, 13)})") + "ended = step\n", stream=False)
    assert "[chaos] rank 3: stalls 13 s before step 10" in out.stdout[3]
    record = lab.heals()
    assert record is not None
    missed = record.skipped[3]
    assert missed[0] == 11 and missed == list(range(11, missed[-1] + 1)) and len(missed) > 1, record.text()
    (back,) = [h for h in record.heals if h.rank == 3 and h.step > 1]
    assert not back.replacement and back.step == missed[-1] + 1 and back.source != 3, record.text()
    assert not any("quorum failed" in text for text in out.stdout.values()), out.stdout
    weights = lab.run("[p.detach().tolist() for p in net.parameters()]", stream=False)
    assert all(weights[r] == weights[0] for r in range(4))
    ended = lab.pull("ended")
    assert ended[3] < ended[0] == ended[1] == ended[2] == 299, "it ended its loop early, at the others' step"


@pytest.mark.parametrize(
    "call, says",
    [
        ("distlab.chaos(kill={5: 1})", "5 is not a rank of this world (0 to 1)"),
        ("distlab.chaos(kill={1: 0})", "rank 1's step must be a whole number from 1"),
        ("distlab.chaos(slow={0: -1})", "rank 0's delay must be seconds, 0 or more"),
        ("distlab.chaos(nan=[1, 2])", "takes a dict of rank to value"),
        ("distlab.chaos(cut={0: 3})", "cuts a node's link, which needs a lab on emulated nodes: %dist start"),
        ("distlab.chaos(stall={1: 5})", "rank 1's stall must be (step from 1, seconds), like stall={1: (40, 15)}"),
        ("distlab.chaos(lighthouse=3)", "kills torchft's lighthouse, which only a lab that heals has: %dist start"),
    ],
)
def test_a_schedule_that_cannot_be_kept_says_why(lab, call, says):
    with pytest.raises(RankError, match=says.replace("(", r"\(").replace(")", r"\)")):
        lab.run(call, stream=False)


def test_a_cut_node_in_a_lab_that_heals_is_fenced_and_its_ranks_come_back(lab_factory):
    # Two nodes of two ranks; node 1's link goes down after step 10. Its ranks are fenced; the
    # quorum of node 0 goes on; the lab brings the link back up to start the replacements there.
    lab = lab_factory(ranks=4, nodes=2, heal=True)
    out = lab.run(HEALING.replace("SCHEDULE", "distlab.chaos(cut={1: 10})"), stream=False, timeout=240)
    record = lab.heals()
    # Node 0's ranks never stopped: every step is theirs. Node 1's were out from step 11 on.
    assert {s.step for s in record.steps if {0, 1} <= set(s.participants)} == set(range(2, 301)), record
    assert min(record.skipped[2]) == min(record.skipped[3]) == 11, record
    assert any("ranks 2-3 died" in note for note in out.notes), out.notes
    weights = lab.run("[p.detach().tolist() for p in net.parameters()]", stream=False)
    assert all(weights[r] == weights[0] for r in range(4)), weights
    # The link is up again: node 1's new ranks and node 0's work together.
    assert lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False) == dict.fromkeys(range(4), 4.0)


def test_a_cut_node_of_a_lab_that_does_not_heal_hangs_its_peers_until_distlab_stops_them(lab_factory):
    # Unlike a death, a cut resets no connection: the others' next all-reduce with node 1 waits.
    lab = lab_factory(ranks=4, nodes=2)
    with pytest.raises(RankError) as failed:
        lab.run(PLAIN.replace("SCHEDULE", "distlab.chaos(cut={1: 2})"), stream=False, timeout=8)
    # Node 0's ranks did not fail by themselves (a dead peer's reset connection would have failed
    # them at once): they waited until distlab stopped them, at the cell's deadline or, if that
    # came first, once the controller heard no heartbeat from node 1 for 5 s (20 beats of 250 ms)
    # and took its ranks for dead.
    assert {failed.value.failures[r].ename for r in (0, 1)} == {"Stopped"}, failed.value
    if not isinstance(failed.value, CellTimeout):
        assert {failed.value.failures[r].ename for r in (2, 3)} == {"EngineError"}, failed.value
    # Node 1's ranks, stuck in the all-reduce and out of reach, were killed: a restart brings the
    # world back, and with it node 1's link.
    lab.restart()
    assert lab.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False) == dict.fromkeys(range(4), 4.0)
    assert "is not a node of this lab (0 to 1)" in _refusal(lab, "distlab.chaos(cut={2: 3})")


def _refusal(lab, call):
    with pytest.raises(RankError) as refused:
        lab.run(call, stream=False)
    return str(refused.value)


def test_a_link_that_cannot_be_set_says_so_in_one_line(monkeypatch):
    from distlab.rank import chaos

    monkeypatch.setattr(chaos, "_LINK", "distlab-no-such-link")
    with pytest.raises(RuntimeError) as info:
        chaos._link("up")
    head = "distlab.chaos could not bring the node's link (distlab-no-such-link) up: "
    said = str(info.value)
    assert said.startswith(head) and len(said) > len(head) and "\n" not in said  # ip's own words follow

