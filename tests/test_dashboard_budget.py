"""The dashboard's message budget, without a kernel: it is charged every widget message that really goes
out (counted where the widgets' comms publish them), and no second of a live cell holds more."""

from __future__ import annotations

import comm

from distlab.dashboard.store import TelemetryStore
from distlab.dashboard.view import Dashboard, DashboardConfig
from distlab.records import Publish, StepRecord


def _record(rank: int, step: int) -> StepRecord:
    return {
        "rank": rank, "step": step, "t": float(step), "epoch": None, "loss": 1.0 / (step + 1), "metrics": {},
        "step_time_s": 0.1, "compute_s": 0.09, "comm_s": 0.01, "idle_s": None,
        "allreduce": [{"bucket": 0, "bytes": 4096, "seconds": 0.01 + 0.001 * rank, "start_s": 0.05}],
        "grad_norm": {"0": 1.0 + step}, "weight_norm": {"0": 2.0}, "update_ratio": {"0": 0.01},
        "checksum": step, "layer_checksums": {"0": step},
    }


def _publish(rank: int, step: int) -> Publish:
    meta = {"rank": rank, "world_size": 2, "run": f"r{rank}", "ddp": True, "layers": ["0"], "grad_bytes": 4096,
            "initial_checksums": {"0": 0}, "timed": True, "notes": [], "closed": False,
            "config": {"stats_every": 1, "checksum_every": 1, "publish_interval_s": 0.05}}
    return {"run": f"r{rank}", "rank": rank, "seq": step + 1, "final": False,
            "meta": meta, "records": [_record(rank, step)]}  # type: ignore[typeddict-item]


def test_the_budget_is_charged_every_message_sent_and_no_second_holds_more(monkeypatch):
    now = [0.0]
    published: list[tuple[float, object]] = []  # (time, comm) of every widget message that went out

    def publish_msg(self: comm.DummyComm, msg_type: str, **content: object) -> None:
        if msg_type == "comm_msg":
            published.append((now[0], self))

    # Widgets get comms that publish (as in a kernel), whatever another test imported (ipykernel's
    # comms, outside a kernel, send nothing).
    monkeypatch.setattr(comm, "create_comm", lambda **args: comm.DummyComm(**args))
    monkeypatch.setattr(comm.DummyComm, "publish_msg", publish_msg)
    store = TelemetryStore(world_size=2)
    board = Dashboard(store, clock=lambda: now[0])
    drawn = []
    for step in range(40):  # 10 s of a cell whose ranks publish every 0.25 s
        for rank in (0, 1):
            store.merge(_publish(rank, step))
        drawn += board.refresh()
        now[0] += 0.25

    ours = {id(w.comm) for w in (*board.figures.values(), board.status)}
    times = [t for t, c in published if id(c) in ours]
    assert board.messages == len(times), "the budget counted what the widgets really sent"
    busiest = max(sum(1 for u in times if t <= u < t + 1.0) for t in times)
    assert busiest <= DashboardConfig().max_messages_per_s
    assert set(drawn) == set(board.figures), "every figure was drawn live"
    board.refresh(force=True)  # the cell's end: everything drawn, whatever the budget
    assert board.status.value.startswith("2 ranks, step 39")


def test_messages_the_front_end_keeps_asking_for_do_not_starve_the_first_redraws(monkeypatch):
    # A live page answered all the time (plotly's figures reply to each resize of their output): some
    # message in every second, so the window is never empty. The figures are still drawn, within the budget.
    now = [0.0]
    published: list[float] = []

    def publish_msg(self: comm.DummyComm, msg_type: str, **content: object) -> None:
        if msg_type == "comm_msg":
            published.append(now[0])

    monkeypatch.setattr(comm, "create_comm", lambda **args: comm.DummyComm(**args))
    monkeypatch.setattr(comm.DummyComm, "publish_msg", publish_msg)
    store = TelemetryStore(world_size=2)
    board = Dashboard(store, clock=lambda: now[0])
    drawn = []
    for step in range(40):
        for rank in (0, 1):
            store.merge(_publish(rank, step))
        board.status.send({"answer": step})  # what the front end asked for, sent between refreshes
        drawn += board.refresh()
        now[0] += 0.25
    assert set(drawn) == set(board.figures), "every figure was drawn live"
    # From the second after the figures were made (their making's messages and the answers in that
    # second are not the redraws'), no second holds more than the budget.
    live = [u for u in published if u >= 1.0]
    busiest = max(sum(1 for u in live if t <= u < t + 1.0) for t in live)
    assert busiest <= DashboardConfig().max_messages_per_s
