"""Spare engines: a local lab keeps registered engines beside its world; a restart forms its new world
on them and a healing lab's replacement takes one; the pool is forked again; nothing outlives the lab."""

from __future__ import annotations

import psutil
import pytest

from distlab.cluster import warm
from distlab.cluster.processes import pid_alive, wait_for
from distlab.errors import LabUsageError
from distlab.notebook.config import LabConfig

ALL_REDUCE = "t = torch.ones(1); dist.all_reduce(t); int(t.item())"


def _registered_spares(lab, count: int) -> set[int]:
    """The pids of the lab's spares once ``count`` of them have registered with the controller (the
    engine ids that are neither ranks nor ranks gone)."""
    def ready() -> bool:
        ranks = {row.engine_id for row in lab.table}
        processes = lab.processes
        return len(processes.spares) == count and len(set(processes.client.ids) - ranks - processes.retired) >= count

    assert wait_for(ready, 60), f"{len(lab.processes.spares)} spares forked, {count} wanted registered"
    return set(lab.processes.spares.pids())


def _with_helpers(pids: set[int]) -> set[int]:
    """The processes and their children (each engine's nanny)."""
    found = set(pids)
    for pid in pids:
        try:
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.cluster
def test_a_restart_forms_its_world_on_the_spares_and_the_pool_is_forked_again(lab_factory):
    lab = lab_factory(ranks=2)
    assert lab.spares == 2
    spares = _registered_spares(lab, 2)
    old = {row.pid for row in lab.table}
    assert not spares & old
    lab.restart()
    # The new world is the spares, the old one is gone, and the world works.
    assert {row.pid for row in lab.table} == spares
    assert wait_for(lambda: not any(pid_alive(pid) for pid in old), 10)  # ended beside the new world
    assert set(lab.run(ALL_REDUCE, stream=False).values()) == {2}
    # New spares were forked in their place; they are neither ranks nor the old world.
    again = _registered_spares(lab, 2)
    assert not again & (spares | old)
    everything = _with_helpers(again | spares)
    assert len(everything) >= 8, everything  # four engines, each with its nanny
    lab.stop()
    assert wait_for(lambda: not any(pid_alive(pid) for pid in everything), 10), [
        pid for pid in everything if pid_alive(pid)
    ]


@pytest.mark.cluster
def test_a_restart_to_a_larger_world_takes_every_spare_and_starts_the_rest(lab_factory):
    lab = lab_factory(ranks=2)
    spares = _registered_spares(lab, 2)
    lab.restart(ranks=3)
    ranks = {row.pid for row in lab.table}
    assert spares < ranks and len(ranks) == 3
    assert set(lab.run(ALL_REDUCE, stream=False).values()) == {3}
    assert not _registered_spares(lab, 3) & ranks  # one spare a rank, at the new size


@pytest.mark.cluster
def test_a_lab_without_spares_keeps_none_and_restarts_on_engines_it_starts(lab_factory):
    lab = lab_factory(ranks=2, spares=0)
    old = {row.pid for row in lab.table}
    assert lab.spares == 0
    lab.restart()
    assert not {row.pid for row in lab.table} & old
    assert set(lab.run(ALL_REDUCE, stream=False).values()) == {2}
    assert lab.spares == 0


@pytest.mark.cluster
def test_a_healing_labs_dead_rank_is_replaced_by_a_spare(lab_factory):
    lab = lab_factory(ranks=2, heal=True)
    # The template imports torchft for a healing lab just after its start; the spares it could not
    # fork meanwhile are forked when a cell starts.
    assert wait_for(lambda: not warm.busy(), 120), "the template's torchft import did not end"
    lab.run("pass", stream=False)
    spares = _registered_spares(lab, 2)
    lab.kill(1)
    assert set(lab.run(ALL_REDUCE, stream=False).values()) == {2}
    assert lab.table[1].pid in spares


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"spares": -1}, "spares must be >= 0"),
        ({"spares": "two"}, "spares must be a whole number"),
        ({"spares": 1, "launcher": "mpi"}, "the mpi launcher starts ranks elsewhere"),
        ({"spares": 1, "nodes": 2}, "nodes starts ranks inside the nodes"),
    ],
)
def test_spares_where_they_cannot_be_kept_say_why_in_one_line(config, said, monkeypatch):
    monkeypatch.setattr("distlab.cluster.nodes.require_namespaces", lambda flag: None)
    with pytest.raises(LabUsageError) as caught:
        LabConfig(ranks=2, **config)
    message = str(caught.value)
    assert said in message and "\n" not in message, message


def test_spares_by_default_are_one_a_rank_where_ranks_are_forked_and_none_elsewhere(monkeypatch):
    assert LabConfig(ranks=3).spare_count == 3
    assert LabConfig(ranks=3, spares=1).spare_count == 1
    monkeypatch.setattr("distlab.cluster.nodes.require_namespaces", lambda flag: None)
    assert LabConfig(ranks=3, nodes=3).spare_count == 0
    monkeypatch.setenv("DISTLAB_WARM", "0")
    assert LabConfig(ranks=3).spare_count == 0
    with pytest.raises(LabUsageError, match="started cold here"):
        LabConfig(ranks=3, spares=1)
