"""A lab's collaborators, each on its own: the observer bus, the world's table, the network's refusals,
profiles, the configuration a lab is built of, and attach's factory. No process is started."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from distlab.cluster.processes import machine_id
from distlab.errors import LabUsageError
from distlab.front.lab import Lab
from distlab.front.profiling import Profiler
from distlab.notebook import kept
from distlab.notebook.config import LabConfig
from distlab.notebook.core import LabCore
from distlab.notebook.lab_world import LabWorld
from distlab.notebook.lifecycle import Phases
from distlab.notebook.nodes import NetworkControls
from distlab.notebook.observers import Observer, ObserverBus
from distlab.notebook.processes import LabProcesses
from distlab.notebook.world import plan_world
from distlab.records import PUBLISH_KEY


class _Told(Observer):
    def __init__(self, name: str, said: list[str], fails_entering: bool = False) -> None:
        self.name, self.said, self.fails_entering = name, said, fails_entering

    def started(self, lab: Any) -> None:
        self.said.append(f"{self.name} started {lab}")

    @contextlib.contextmanager
    def cell(self, lab: Any, stream: bool) -> Iterator[None]:
        if self.fails_entering:
            raise RuntimeError(f"{self.name} cannot show the cell")
        self.said.append(f"{self.name} in")
        try:
            yield
        finally:
            self.said.append(f"{self.name} out")


def test_the_bus_tells_observers_in_order_and_the_cells_end_before_their_views_close():
    said: list[str] = []
    bus = ObserverBus("the lab")
    bus.observe(_Told("panel", said))
    bus.observe(_Told("bars", said))
    bus.tell("started")
    assert said == ["panel started the lab", "bars started the lab"]
    said.clear()
    with bus.cell_views(stream=True, ended=lambda: said.append("ended")):
        said.append("runs")
    assert said == ["panel in", "bars in", "runs", "ended", "bars out", "panel out"]


def test_a_view_that_cannot_enter_a_cell_closes_the_views_already_entered():
    said: list[str] = []
    bus = ObserverBus("the lab")
    bus.observe(_Told("panel", said))
    bus.observe(_Told("broken", said, fails_entering=True))
    with pytest.raises(RuntimeError, match="broken cannot show"):
        bus.cell_views(stream=True, ended=lambda: said.append("ended"))
    assert said == ["panel in", "panel out"], "the cell never ran: it did not end either"


def test_listeners_hear_each_poll_in_the_order_they_were_added_until_removed():
    heard: list[tuple[str, bool]] = []
    bus = ObserverBus(None)
    first, second = (lambda p, f: heard.append(("first", f))), (lambda p, f: heard.append(("second", f)))
    bus.add_listener(first)
    bus.add_listener(second)
    bus.poll({}, False)
    bus.remove_listener(first)
    bus.remove_listener(first)  # one not there is ignored
    bus.poll({}, True)
    assert heard == [("first", False), ("second", False), ("second", True)]


def test_a_labs_telemetry_reads_a_poll_before_any_listener_added_before_the_store_was_made():
    lab = Lab(ranks=2)
    seen: list[int] = []
    lab.add_listener(lambda pending, final: seen.append(lab.telemetry.version))  # the store is made here

    published = SimpleNamespace(
        data={PUBLISH_KEY: {"run": "r", "rank": 0, "seq": 1, "final": False, "meta": {}, "records": [{"step": 0}]}}
    )
    before = lab.telemetry.version
    lab.bus.poll({0: published}, False)
    assert seen == [lab.telemetry.version] and seen[0] > before, "the listener saw the store after it read the poll"


def _world(processes: LabProcesses, ranks: int = 3) -> LabWorld:
    world = LabWorld(processes, timeout=5.0, debug=False)
    identities = {
        10 + i: {"host": "a", "pid": 100 + i, "addr": "10.0.0.1", "cuda_devices": 0, "launcher_rank": None,
                 "python": "3.11", "torch": "2.13.0", "machine": machine_id() if i < 2 else "elsewhere"}
        for i in range(ranks)
    }
    world.current = plan_world(identities, ranks, "gloo")
    return world


def test_the_world_numbers_its_engines_and_gives_a_dead_ranks_row_to_its_replacement():
    world = _world(LabProcesses(5.0))
    assert [r.engine_id for r in world.table] == [10, 11, 12] and world.engine_ids == {10, 11, 12}
    assert world.local_pids() == [100, 101], "the rank on another machine is its launcher's to end"
    assert world.ranks("0,2", 3) == [0, 2] and world.ranks(None, 3) == [0, 1, 2]
    with pytest.raises(LabUsageError):
        world.ranks(3, 3)
    before = world.current
    new = dataclasses.replace(world.table[1], engine_id=20, pid=200)
    after = world.put(1, new)
    assert [r.engine_id for r in world.table] == [10, 20, 12] and after is world.current and before is not after
    assert before is not None and before.table[1].engine_id == 11, "the old world is left as it was"
    world.clear()
    assert world.table == [] and world.engine_ids == frozenset()


def test_a_lab_without_nodes_refuses_to_reshape_links_in_one_line():
    network = NetworkControls(LabProcesses(5.0))
    assert network.link is None and network.uplink is None and network.caption() == "" and network.racks([]) == []
    with pytest.raises(LabUsageError, match=r"^set_link needs a lab on emulated nodes: start one like"):
        network.set_link(LabConfig(), "1gbit")
    with pytest.raises(LabUsageError, match=r"^link_bytes needs a lab on emulated nodes"):
        network.link_bytes()


def test_each_phase_is_timed_from_the_end_of_the_one_before():
    timings: dict[str, float] = {}
    phase = Phases(timings)
    phase("controller_s")
    phase("engines_s")
    phase.total("ready_s")
    assert set(timings) == {"controller_s", "engines_s", "ready_s"}
    assert timings["ready_s"] >= timings["controller_s"] + timings["engines_s"]


def test_a_profile_is_armed_for_one_cell_and_checked_before_the_lab_is_asked_whether_it_runs():
    asked: list[str] = []
    profiler = Profiler(LabProcesses(5.0), LabWorld(LabProcesses(5.0), 5.0, False), 5.0, "lab-1-a")
    with pytest.raises(LabUsageError, match="steps"):
        profiler.profile(0, 1, None, require_running=lambda: asked.append("running?"))
    assert asked == [], "a bad argument is said first"
    first = profiler.profile(3, 1, None, require_running=lambda: asked.append("running?"))
    second = profiler.profile(2, 0, None, require_running=lambda: None)
    assert asked == ["running?"] and not first.armed and second.armed, "the latest profile asked for is armed"
    assert profiler.armed is second
    second.disarm()
    assert profiler.armed is None
    assert profiler.around([0], lambda: "ran") == "ran", "no profile armed: the cell just runs"


def test_the_configuration_is_written_once_and_a_lab_is_built_of_it_by_keyword_or_whole():
    assert LabCore(3, backend="gloo").config == LabConfig(ranks=3, backend="gloo")
    config = LabConfig(ranks=2, timeout=12.0)
    assert LabCore(config=config).config is config and Lab.from_config(config).config is config
    assert LabCore(config=config, ranks=4).config == LabConfig(ranks=4, timeout=12.0), "keywords override"
    with pytest.raises(LabUsageError, match="ranks"):
        LabCore(config=config, ranks=0)  # checked again
    with pytest.raises(TypeError, match="not both"):
        LabCore(4, config=config)
    with pytest.raises(TypeError, match="rnks"):
        Lab(rnks=2)
    flags = argparse.Namespace(**{f.name: getattr(config, f.name) for f in dataclasses.fields(LabConfig)})
    assert LabConfig.of_args(flags, spelling="magic") == config
    with pytest.raises(LabUsageError, match="-n"):  # the magic's spelling names its flag
        LabConfig.of_args(argparse.Namespace(**{**vars(flags), "ranks": 0}), spelling="magic")


def test_a_stopped_lab_says_so_in_one_line_before_touching_any_collaborator():
    lab = Lab(ranks=2)
    assert not lab.running and lab.table == [] and lab.spares == 0 and lab.heals() is None
    assert repr(lab) == "<Lab stopped: 2 ranks, backend=auto, launcher=local>"
    for call in (lab.status, lab.stacks, lab.link_bytes, lambda: lab.run("1"), lambda: lab.set_link("1gbit")):
        with pytest.raises(LabUsageError, match="no lab is running"):
            call()
    with pytest.raises(LabUsageError, match="only a kept lab can be let go of"):
        lab.detach()


def test_attach_takes_a_kept_lab_back_into_the_lab_its_factory_makes(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(LabUsageError, match="no kept lab to attach here"):
        kept.attach(factory=lambda config: pytest.fail("nothing to take back"))
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text("{}")
    config = {f.name: getattr(LabConfig(ranks=2, keep=60), f.name) for f in dataclasses.fields(LabConfig)}
    record = {"id": "lab-1-a", "cluster_id": "c1", "cluster_file": str(cluster_file), "owner": os.getpid(),
              "config": config, "world": {"table": []}, "started": 1.0}
    kept.record_path("c1").parent.mkdir(parents=True)
    kept.record_path("c1").write_text(json.dumps(record))
    taken: list[tuple[LabConfig, dict[str, Any]]] = []

    class Taking:
        def __init__(self, config: LabConfig) -> None:
            self.config = config

        def take_back(self, record: dict[str, Any]) -> None:
            taken.append((self.config, record))

    lab = kept.attach(timeout=7.0, factory=Taking)
    assert isinstance(lab, Taking) and lab.config == LabConfig(ranks=2, keep=60, timeout=7.0)
    assert [r["id"] for _, r in taken] == ["lab-1-a"]
