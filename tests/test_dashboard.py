"""The dashboard as the notebook gets it: stragglers marked, the widget message rate bounded in a
real kernel, and the final state kept for saved notebooks."""

from __future__ import annotations

import base64
import datetime
import struct

import pytest
from _jupyter import execute, wait_for
from jupyter_client.manager import start_new_kernel

from distlab.dashboard import analysis
from distlab.dashboard.view import DashboardConfig

pytestmark = pytest.mark.cluster

# A small DDP model; rank 1 starts each backward LAGS_S[step % 2] late (0.1 s on even steps, 0.3 s on
# odd ones), so rank 0 waits for it in every all-reduce: both far longer than the all-reduce of a few
# hundred floats, and than a busy scheduler keeps a process off a core.
LATE_RANK = r"""
import time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with distlab.watch(model, stats_every=0, checksum_every=0):
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(torch.randn(16, 8)).square().mean()
        if rank == 1:
            time.sleep(LAGS_S[step % 2])  # between forward and backward: rank 0 waits in the all-reduce
        loss.backward()
        opt.step()
        distlab.log(loss=loss)
"""


def test_a_rank_that_starts_its_backward_late_is_the_straggler_marked_on_the_timeline(lab):
    short, long = 0.1, 0.3
    lab.push(STEPS=8, LAGS_S=(short, long))
    lab.run(LATE_RANK, stream=False)
    records = lab.telemetry.records()
    late = analysis.stragglers(records)
    buckets = {(r["step"], b["bucket"]) for r in records for b in r["allreduce"]}
    assert buckets and {(s.step, s.bucket) for s in late} == buckets, "every all-reduce waited for rank 1"
    assert {s.rank for s in late} == {1}
    # The lag is the wait rank 1 caused, not a duration of something else: each long step's lag
    # exceeds the short step's before it by most of the 0.2 s between them. Neighbouring steps
    # compared, so load on the machine that stretches both does not change the difference.
    # Step 0 is left out: DDP's first iteration does more (its buckets are rebuilt after it), and
    # under load its lag was seen at 0.21 s instead of 0.1, a gap of 0.09 to step 1's.
    lag = {s.step: s.lag_s for s in late}  # one bucket a step: the model is a few hundred floats
    gaps = [lag[step] - lag[step - 1] for step in range(3, 8, 2)]
    assert all(gap > (long - short) / 2 for gap in gaps), lag

    # The summary says of how many all-reduces: every one here.
    said = [line for line in analysis.summary(records, lab.telemetry.meta(), 2) if "stragglers" in line]
    assert said == [f"  stragglers: rank 1 arrived last, the others waiting for it, in {len(buckets)} of "
                    f"{len(buckets)} all-reduces"], said

    board = lab.dashboard()
    board.refresh(force=True)
    bars, marks, _others = board.figures["timeline"].data
    shown = {int(h.split(",")[0].removeprefix("step ")) for h in bars.hovertext}
    assert shown == set(range(8 - DashboardConfig().timeline_steps, 8))
    # One mark per late all-reduce of the steps shown, each on rank 1's row.
    expected = [s for s in late if s.step in shown]
    assert list(marks.y) == ["rank 1"] * len(expected)
    assert f"{len(expected)} late arrivals" in board.figures["timeline"].layout.title.text


# ------------------------------------------------------------------ in a real kernel

_FAST_PUBLISHER = """%%ddp
import os, time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
# Twenty publishes a second per rank: far more changes than the dashboard may draw. 300 steps (about
# 4 s), and on until the test has seen the dashboard redraw live for long enough (it makes SEEN; at
# most 2 minutes): on a loaded machine the dashboard may show late. Both ranks agree each step on
# whether to go on (an all-reduce of the flag), so they make the same all-reduces.
deadline = time.monotonic() + 120
with distlab.watch(model, publish_interval_s=0.05, stats_every=5, checksum_every=5):
    step, go_on = 0, True
    while go_on:
        opt.zero_grad()
        loss = model(torch.randn(16, 8)).square().mean()
        loss.backward()
        opt.step()
        distlab.log(loss=loss)
        time.sleep(0.01)
        step += 1
        waiting = step < 300 or not (os.path.exists(SEEN) or time.monotonic() > deadline)
        flag = torch.tensor([float(waiting)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        go_on = bool(flag.item())
"""
# Seconds of live redraws (after the dashboard showed) the test waits to see before the cell may end:
# more than the assertion below needs, for the redraws in the cell's last moments that it leaves out.
_LIVE_SECONDS = 6


def _sent_at(msg: dict) -> float:
    date = msg["header"]["date"]
    if isinstance(date, str):
        date = datetime.datetime.fromisoformat(date)
    return date.timestamp()


def test_a_watched_cell_shows_the_dashboard_live_within_the_message_budget_and_keeps_its_last_state(tmp_path):
    seen = tmp_path / "seen"
    shown: list[dict] = []  # the dashboard's display, once it came
    live_seconds: set[int] = set()  # whole seconds with a redraw since

    def watch(msg: dict) -> None:  # while the cell runs: once redraws span enough seconds, it may end
        if msg["msg_type"] == "display_data":
            shown.append(msg)
        elif msg["msg_type"] == "comm_msg" and shown:
            live_seconds.add(round(_sent_at(msg)))
            if len(live_seconds) >= _LIVE_SECONDS:
                seen.touch()

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        execute(kc, "%load_ext distlab\n%dist start -n 2")
        # In a kernel, a started lab loads the dashboard's modules in the background, before any
        # cell watches a model (so the first dashboard need not wait for them).
        loaded = "import sys; print('distlab.dashboard.figures' in sys.modules and 'plotly.graph_objs' in sys.modules)"
        wait_for(lambda: execute(kc, loaded).strip() == "True", 120, "the dashboard's modules to load", poll_s=0.5)
        # The dashboard the cell will show, held here: after the cell it is closed, and says what
        # its forced redraws (the cell's end: every figure, outside the budget) sent.
        execute(kc, "from distlab.notebook import labs\nboard = labs.current().dashboard()")
        messages: list[dict] = []
        execute(kc, _FAST_PUBLISHER.replace("SEEN", repr(str(seen))), timeout=300, messages=messages, on_message=watch)
        forced = [int(n) for n in execute(kc, "print(*board.forced_messages)").split()]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)

    kinds = [m["msg_type"] for m in messages]
    texts = [m["content"].get("text", "") for m in messages if m["msg_type"] == "stream"]
    assert not any("rate exceeded" in t for t in texts), texts
    assert "display_data" in kinds, "the dashboard was not shown"
    shown_at = _sent_at(next(m for m in messages if m["msg_type"] == "display_data"))
    updates = [m for m in messages if m["msg_type"] == "comm_msg"]
    # The final redraw (every figure at once, whatever the budget) is the last widget messages
    # before the display turns into the still picture: as many as the dashboard counted.
    assert len(forced) == 1 and forced[0] > 0, forced
    final_at = _sent_at(next(m for m in messages if m["msg_type"] == "update_display_data"))
    before_final = [m for m in updates if _sent_at(m) < final_at]
    live = sorted(_sent_at(m) for m in before_final[: len(before_final) - forced[0]])
    redraws_after_shown = {round(t) for t in live if t > shown_at + 0.5}
    assert len(redraws_after_shown) >= 3, "the dashboard did not keep updating while the cell ran"
    busiest = max(sum(1 for u in live if t <= u < t + 1.0) for t in live)
    assert busiest <= DashboardConfig().max_messages_per_s, f"{busiest} widget messages in one second"

    # The saved notebook's view: the widgets become a picture of the last state, with the text
    # summary beside it; nothing in it needs a kernel (no widget view left to say "model not found").
    final = next(m for m in messages if m["msg_type"] == "update_display_data")["content"]["data"]
    text = final["text/plain"]
    assert text.startswith("distlab dashboard: 2 ranks, steps 0-"), text
    assert "replicas agree" in text, text
    assert not any("widget" in mime for mime in final), list(final)
    png = base64.b64decode(final["image/png"])
    width, height = struct.unpack(">II", png[16:24])
    assert png.startswith(b"\x89PNG") and width == 880 and height > 512  # 11 in at 80 dpi; the summary under the plots
    assert set(final) == {"image/png", "text/plain"}  # one copy of the picture
