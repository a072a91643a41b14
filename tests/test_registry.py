"""What a lab tells the side panel (its registry file) follows the lab, through restarts at a new size."""

from __future__ import annotations

import pytest

from distlab.records import PUBLISH_KEY
from distlab.server import registry

WATCHED_STEPS = """
import time
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with distlab.watch(model, publish_interval_s=PUBLISH_S):
    for step in range(STEPS):
        time.sleep(PAUSE_S)
        opt.zero_grad()
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        distlab.log(loss=loss)
"""


def _panel_view(lab: object) -> dict:
    (entry,) = [e for e in registry.read_labs() if e["id"] == registry.id_of(lab)]
    return entry


@pytest.mark.cluster
def test_after_a_restart_at_a_new_size_the_panel_shows_the_cells_last_step_not_the_previous_poll(lab_factory):
    lab = lab_factory(ranks=1)
    lab.restart(ranks=2)  # telemetry is per world: the lab makes a new store on its next use
    # Few, quick steps: all of them reach the notebook in the cell's final poll, so a panel that read
    # the store before the store read that poll would show none of them.
    lab.push(STEPS=5, PAUSE_S=0.0, PUBLISH_S=1.0)
    lab.run(WATCHED_STEPS, stream=False)
    last = max(rec["step"] for rec in lab.telemetry.records())
    view = _panel_view(lab)
    assert view["world_size"] == 2 and len(view["ranks"]) == 2
    assert view["training"]["step"] == last == 4


@pytest.mark.cluster
def test_listeners_see_the_telemetry_store_after_it_has_read_the_same_poll_even_after_a_resize(lab_factory):
    lab = lab_factory(ranks=1)
    lab.restart(ranks=2)
    lagging: list[tuple[int, int]] = []  # (rank, step) a rank had published that the store had not read

    def check(pending: dict, final: bool) -> None:
        stored = {(rec["rank"], rec["step"]) for rec in lab.telemetry.records()}
        for ar in pending.values():
            payload = (ar.data or {}).get(PUBLISH_KEY)
            if payload and payload["records"]:
                newest = payload["records"][-1]
                if (newest["rank"], newest["step"]) not in stored:
                    lagging.append((newest["rank"], newest["step"]))

    lab.add_listener(check)  # added before the lab makes its new store
    # Steps spread over about 2 s, published every 0.2 s: many polls bring new records.
    lab.push(STEPS=20, PAUSE_S=0.1, PUBLISH_S=0.2)
    lab.run(WATCHED_STEPS, stream=False)
    assert {rec["step"] for rec in lab.telemetry.records()} == set(range(20))
    assert lagging == []
