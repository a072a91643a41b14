"""``distlab.chaos``: faults on a schedule inside a cell, counted in optimizer steps, on real ranks."""

from __future__ import annotations

import textwrap

import pytest

from distlab import RankError

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


def test_kill_in_a_lab_that_heals_kills_once_and_the_replacement_goes_on(lab_factory):
    lab = lab_factory(ranks=2, heal=True)
    code = textwrap.dedent(
        """
        import time
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2)
        model, opt = distlab.heal(net, torch.optim.SGD(net.parameters(), lr=0.1))
        distlab.chaos(kill={1: 10})
        for step in range(150):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            time.sleep(0.05)
        """
    )
    out = lab.run(code, stream=False)
    assert any("healed from a live peer" in note for note in out.notes), out.notes
    # The replacement healed past step 10: it was not killed again (its output is the new process's).
    assert "[chaos]" not in out.stdout[1]
    weights = lab.run("[p.detach().tolist() for p in net.parameters()]", stream=False)
    assert weights[0] == weights[1]


@pytest.mark.parametrize(
    "call, says",
    [
        ("distlab.chaos(kill={5: 1})", "5 is not a rank of this world (0 to 1)"),
        ("distlab.chaos(kill={1: 0})", "rank 1's step must be a whole number from 1"),
        ("distlab.chaos(slow={0: -1})", "rank 0's delay must be seconds, 0 or more"),
        ("distlab.chaos(nan=[1, 2])", "takes a dict of rank to value"),
        ("distlab.chaos(cut={0: 3})", "is not built yet: kill each of the node's ranks"),
    ],
)
def test_a_schedule_that_cannot_be_kept_says_why(lab, call, says):
    with pytest.raises(RankError, match=says.replace("(", r"\(").replace(")", r"\)")):
        lab.run(call, stream=False)
