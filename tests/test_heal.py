"""Labs that heal (``heal=True``): torchft's lighthouse beside the ranks, a per-step quorum in the
cell, and a rank's death that does not stop the others."""

from __future__ import annotations

import textwrap

import psutil
import pytest

import distlab
from distlab import LabUsageError, RankError
from distlab.cluster.processes import pid_alive, wait_for

pytestmark = pytest.mark.cluster

# Every rank trains the same model from the same seed on batches of its own; rank VICTIM kills its own
# process (a crash, as the kernel sees it) once it has committed step DIES_AT. Every committed step
# is kept with the time it committed; the time of the death is written to a file first.
TRAIN = textwrap.dedent(
    """
    import os, signal, time
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distlab.heal(model, opt)
    manager = distlab.rank.heal.current().manager
    committed = []
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(torch.randn(16, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        committed.append((manager.current_step(), time.time()))
        if rank == VICTIM and manager.current_step() == DIES_AT and not os.path.exists(DEATH_FILE):
            with open(DEATH_FILE, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(STEP_S)
    after_loop = manager.current_step()
    """
)


def _train(victim: int, steps: int, dies_at: int, death_file: str, step_s: float = 0.02) -> str:
    return (
        TRAIN.replace("STEPS", str(steps)).replace("VICTIM", str(victim)).replace("DIES_AT", str(dies_at))
        .replace("DEATH_FILE", repr(death_file)).replace("STEP_S", str(step_s))
    )


def _listening(pid: int) -> list[tuple[str, int]]:
    return [tuple(c.laddr) for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


# Rank 0 kills the lighthouse after step 5 (``distlab.chaos``); the loop's 30 steps go on.
LIGHTHOUSE_DIES = textwrap.dedent(
    """
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    model, opt = distlab.heal(net, torch.optim.SGD(net.parameters(), lr=0.05))
    distlab.chaos(lighthouse=5)
    manager = distlab.rank.heal.current().manager
    for step in range(30):
        opt.zero_grad()
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
    final = manager.current_step()
    """
)


def test_a_lab_that_heals_runs_its_lighthouse_on_the_labs_address_starts_it_again_when_it_dies_and_ends_it(
    lab_factory,
):
    lab = lab_factory(ranks=2, heal=True)
    lighthouse = lab.healer.lighthouse
    assert lighthouse is not None and lighthouse.address.startswith("http://127.0.0.1:")
    listening = _listening(lighthouse.pid)
    assert listening and all(ip == "127.0.0.1" for ip, _ in listening), listening
    # Every rank was told where it is.
    seen = lab.run("import os; os.environ['TORCHFT_LIGHTHOUSE']", stream=False)
    assert set(seen.values()) == {lighthouse.address}
    # Killed while the ranks train: the lab starts it again on the same address; the quorum the
    # ranks were waiting for is lost (torchft's quorum timeout, 30 s), that one step does not commit,
    # and the loop goes on with the new lighthouse.
    ran = lab.run(LIGHTHOUSE_DIES, stream=False, timeout=120)
    (note,) = [n for n in ran.notes if "lighthouse died" in n]
    assert "killed by signal 9" in note and "started it again on the same address" in note, note
    again = lab.healer.lighthouse
    assert again is not None and again.pid != lighthouse.pid and again.address == lighthouse.address
    assert _listening(again.pid) == listening
    assert not pid_alive(lighthouse.pid)
    pgids = lab.processes.guard.pgids()
    assert again.pid in pgids and lighthouse.pid not in pgids, "the guard ends the new one, not the old number"
    assert "[chaos] rank 0: torchft's lighthouse killed after step 5" in ran.stdout[0]
    for rank in (0, 1):
        assert "step 6: torchft's quorum failed" in ran.stdout[rank], ran.stdout[rank]
    assert lab.pull("final") == {0: 29, 1: 29}, "30 steps, the one whose quorum was lost not committed"
    weights = lab.run(WEIGHTS.replace("model.", "net."), stream=False)
    assert len(set(weights.values())) == 1, weights
    lab.stop()
    assert wait_for(lambda: not pid_alive(again.pid), 10)


WEIGHTS = (
    "import hashlib\n"
    "hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()"
)


def test_a_rank_that_dies_is_replaced_heals_from_a_peer_and_the_cell_ends_on_every_rank_identical(
    lab_factory, tmp_path
):
    lab = lab_factory(ranks=3, heal=True)
    before = {row.rank: row.pid for row in lab.status()}
    death_file = str(tmp_path / "died")
    # The others train on for 185 steps of 50 ms: time enough for the replacement to join them (about
    # 2 s, benchmarks/bench_heal.py), on a loaded machine too.
    ran = lab.run(_train(victim=1, steps=200, dies_at=15, death_file=death_file, step_s=0.05), stream=False)
    assert any("healed from a live peer" in note for note in ran.notes), ran.notes
    with open(death_file) as f:
        died_at = float(f.read())
    after = {row.rank: row for row in lab.status()}
    assert after[1].pid != before[1] and after[1].health == "ok"
    assert [after[r].pid for r in (0, 2)] == [before[0], before[2]]
    # The replacement ran the cell from its top: its first committed step is past the death (it
    # healed to the others' step at its first quorum), and it ended at the others' last step.
    result = lab.run("committed", stream=False)
    steps = {r: [s for s, _ in committed] for r, committed in result.items()}
    assert steps[0] == steps[2]
    assert steps[1][0] > 15 and steps[1][-1] == steps[0][-1], steps[1]
    assert set(steps[1]) <= set(steps[0])
    # The survivors went on: steps committed after the death, the counter never going back, at
    # most the steps in flight lost. Generous deadlines: a survivor left to wait out its collective
    # timeout would take 10 s; what healing really costs is measured in benchmarks/bench_heal.py.
    times = {r: [t for _, t in committed] for r, committed in result.items()}
    survived = [t for s, t in result[0] if s > 15]  # committed without rank 1 (it died after step 15)
    assert survived and survived[0] - died_at < 8.0, (died_at, survived[:1])
    assert steps[0] == sorted(steps[0]) and 200 - 3 <= steps[0][-1] <= 200, steps[0]
    assert times[1][0] - died_at < 20.0
    # The line after the loop ran on the replacement too, at the step the others ended at.
    assert lab.run("after_loop", stream=False) == dict.fromkeys(range(3), steps[0][-1])
    assert not any("lacks" in note for note in ran.notes), ran.notes
    # Every rank ends with the same weights, and the next cell has the whole world's group again.
    weights = lab.run(WEIGHTS, stream=False)
    assert len(set(weights.values())) == 1, weights
    total = lab.run("t = torch.ones(1); dist.all_reduce(t); int(t.item())", stream=False)
    assert set(total.values()) == {3}


def test_a_replacement_that_comes_after_the_others_ended_is_given_their_state(lab_factory, tmp_path):
    lab = lab_factory(ranks=2, heal=True)
    death_file = str(tmp_path / "died")
    # Rank 1 dies after the last step: the others end at once, before any replacement can join them.
    ran = lab.run(_train(victim=1, steps=20, dies_at=20, death_file=death_file), stream=False)
    assert any("came after the others had ended the cell" in note for note in ran.notes), ran.notes
    # It ran none of the cell past its first step: the note names what the others' cell defined after that.
    (lacking,) = [note for note in ran.notes if "lacks" in note]
    assert lacking.startswith("rank 1's replacement") and "after_loop" in lacking.split("lacks ")[1], lacking
    weights = lab.run(WEIGHTS, stream=False)
    assert len(set(weights.values())) == 1, weights
    # The replacement never trained alone past the others: it ended its cell at its first step.
    assert lab.run("len(committed)", stream=False)[1] == 0


def test_heal_where_it_cannot_work_says_why_and_starts_nothing(lab):
    before = {p.pid for p in psutil.process_iter()}
    with pytest.raises(LabUsageError, match="heal needs the ranks on this machine"):
        distlab.start(ranks=2, heal=True, launcher="mpi")
    with pytest.raises(LabUsageError, match="gloo"):
        distlab.start(ranks=2, heal=True, backend="nccl")
    with pytest.raises(LabUsageError, match="heal must be True or False"):
        distlab.start(ranks=2, heal="yes")
    started = {p.pid for p in psutil.process_iter()} - before
    assert not [p for p in started if pid_alive(p) and "lighthouse" in " ".join(_cmdline(p))]
    # In a lab that does not heal, and with a model already wrapped, the rank says what to do.
    with pytest.raises(RankError, match=r"%dist start -n 4 --heal"):
        lab.run("distlab.heal(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))",
                stream=False)


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def test_a_rank_killed_between_cells_is_started_again_before_the_next_and_the_group_is_whole(lab_factory, capsys):
    lab = lab_factory(ranks=2, heal=True)
    old = lab.status()[1].pid
    lab.kill(1)
    total = lab.run("t = torch.ones(1); dist.all_reduce(t); int(t.item())", stream=False)
    assert set(total.values()) == {2}
    assert lab.status()[1].pid != old
    assert "rank 1 had died: a new process took its place" in capsys.readouterr().out


# Rank 1 is killed after step 20 (``distlab.chaos``); its replacement waits 2 s before it joins (the
# file says it is the replacement), so that the others step without it for a while after the
# lighthouse has given up on it (1 s). The others stop 5 steps after the whole quorum is back.
CHAOS = textwrap.dedent(
    """
    import os, time
    if rank == 1 and os.path.exists(MARK):
        time.sleep(2.0)
    open(MARK, "w").close()
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    model, opt = distlab.heal(net, torch.optim.SGD(net.parameters(), lr=0.1))
    manager = distlab.rank.heal.current().manager
    distlab.chaos(kill={1: 20})
    whole = 0
    for step in range(600):
        opt.zero_grad()
        model(torch.ones(3, 8)).sum().backward()
        opt.step()
        whole += manager.current_step() > 20 and manager.num_participants() == 3
        if whole == 5:
            break
        time.sleep(0.02)
    """
)


def test_the_record_of_a_healing_cell_shows_the_quorum_without_the_dead_rank_its_skipped_steps_and_its_heal(
    lab_factory, tmp_path, capsys
):
    lab = lab_factory(ranks=3, heal=True)
    ran = lab.run(CHAOS.replace("MARK", repr(str(tmp_path / "ran"))))
    assert any("healed from a live peer" in note for note in ran.notes), ran.notes
    record = lab.heals()
    assert record is not None and record.ranks == (0, 1, 2)
    (heal,) = [h for h in record.heals if h.replacement]
    # Healed from a live rank, sent the model's state: a Linear(8, 4)'s 36 float32s (SGD keeps none).
    assert heal.rank == 1 and heal.source in (0, 2) and heal.bytes == 36 * 4 and heal.seconds > 0
    # The steps without rank 1: from the one after its death to the one its replacement healed in
    # (where it was a member, not a participant); every other step had all three.
    two = [s.step for s in record.steps if s.participants == (0, 2)]
    assert two == list(range(21, heal.step + 1)) and len(two) >= 2, two
    assert record.step(heal.step).members == (0, 1, 2)
    assert all(s.members == (0, 2) for s in record.steps if 21 <= s.step < heal.step)
    assert all(s.participants == (0, 1, 2) for s in record.steps if 1 < s.step < 21 or s.step > heal.step)
    assert record.skipped == {0: [], 1: list(range(21, heal.step)), 2: []}
    assert record.marks()[1][heal.step - 1] == "healed"
    # Outside a kernel, the cell that streamed its output printed the record at its end.
    assert record.text() in capsys.readouterr().out
