"""tqdm on the ranks, drawn in the notebook: the rank side reports and writes nothing, the notebook
side draws one widget within its message budget and leaves text; then all of it in a real kernel."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import time
from collections.abc import Iterator
from typing import Any

import comm
import pytest
from _jupyter import execute
from jupyter_client.manager import start_new_kernel

from distlab.dashboard.progress import CellProgress, ProgressConfig, render_html, render_text, rows_of, text_line
from distlab.wire import PROGRESS_KEY, ProgressBar, ProgressPublish


def _bar(id: int, n: float, total: float | None, desc: str = "", **more: Any) -> ProgressBar:
    bar: ProgressBar = {
        "id": id, "n": n, "total": total, "desc": desc, "unit": "it", "unit_scale": False, "postfix": "",
        "elapsed": 2.1, "rate": 95.3, "closed": False,
    }  # fmt: skip
    bar.update(more)  # type: ignore[typeddict-item]
    return bar


# ------------------------------------------------------------------ the text a saved notebook keeps


def test_a_bar_reads_as_tqdm_draws_it_labelled_by_its_rank_and_desc():
    assert text_line(0, _bar(0, 200, 200, "train", closed=True)) == (
        "rank 0 train: 100%|████████████████████| 200/200 [00:02<00:00, 95.30it/s]"
    )
    assert (
        text_line(3, _bar(0, 50, 200, "train: "))
        == "rank 3 train:  25%|█████               | 50/200 [00:02<00:01, 95.30it/s]"
    )
    assert text_line(1, _bar(0, 7, None)) == "rank 1: 7 [00:02, 95.30it/s]", "no total: no bar, no percentage"
    slow = _bar(0, 3, 10, "epoch", rate=0.25, elapsed=3725.0, postfix="loss=0.31")
    assert text_line(0, slow) == "rank 0 epoch:  30%|██████              | 3/10 [1:02:05<00:28, 4.00s/it, loss=0.31]"
    big = _bar(0, 1_500_000, 3_000_000, unit="B", unit_scale=True, rate=2_500_000.0, elapsed=0.6)
    assert text_line(0, big) == "rank 0:  50%|██████████          | 1.50M/3.00M [00:00<00:00, 2.50MB/s]"
    assert text_line(0, _bar(0, 0, 5, rate=None)) == "rank 0:   0%|                    | 0/5 [00:02<?, ?it/s]"


def test_rows_go_by_rank_then_by_the_order_each_rank_made_its_bars_and_the_text_aligns_them():
    bars = {
        1: [_bar(0, 2, 2, "epoch", closed=True), _bar(1, 30, 30, "step", closed=True)],
        0: [_bar(0, 2, 2, "epoch", closed=True), _bar(5, 30, 30, "step", closed=True)],
    }
    rows = rows_of(bars)
    assert [(rank, index, bar["desc"]) for rank, index, bar in rows] == [
        (0, 0, "epoch"), (0, 1, "step"), (1, 0, "epoch"), (1, 1, "step"),
    ]  # fmt: skip
    lines = render_text(rows).splitlines()
    assert [line.split(":")[0] for line in lines] == ["rank 0 epoch", "rank 0 step ", "rank 1 epoch", "rank 1 step "]
    assert all("|" in line for line in lines) and len({line.index("|") for line in lines}) == 1
    html = render_html(rows)
    assert html.count("<tr>") == 4 and html.count("<progress") == 4
    assert "&lt;b&gt;" in render_html(rows_of({0: [_bar(0, 1, 2, "<b>")]})), "a desc is text, not markup"


def test_outside_a_kernel_the_last_state_of_each_bar_is_printed_once_at_the_end(capsys):
    bars = CellProgress(live=False)
    publish: ProgressPublish = {"rank": 1, "seq": 2, "bars": [_bar(0, 10, 10, "a", closed=True)]}
    assert bars.merge(1, publish)
    assert not bars.merge(1, {"rank": 1, "seq": 1, "bars": [_bar(0, 3, 10, "a")]}), "an older publish is ignored"
    assert bars.merge(0, {"rank": 0, "seq": 1, "bars": [_bar(0, 4, 10, "a")]})
    assert not bars.merge(0, {"rank": 0}), "a publish without its fields changes nothing"  # type: ignore[typeddict-item]
    bars.on_poll({}, final=False)
    assert capsys.readouterr().out == "", "nothing while the cell runs"
    bars.finish()
    bars.finish()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("rank 0 a:  40%") and out[1].startswith("rank 1 a: 100%")
    assert "10/10" in out[1]
    nothing = CellProgress(live=False)
    nothing.finish()
    assert capsys.readouterr().out == "", "a cell whose ranks made no bar shows nothing"


# ------------------------------------------------------------------ the widget's message budget


class _Sent(list):
    """(clock, comm, data) of every widget message that went out; ``clock[0]`` is the views' clock."""

    clock: list[float]


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> _Sent:
    """Every widget message that goes out, as a kernel would send it."""
    sent = _Sent()
    sent.clock = [0.0]

    def publish_msg(self: comm.DummyComm, msg_type: str, data: Any = None, **rest: Any) -> None:
        if msg_type == "comm_msg":
            sent.append((sent.clock[0], self, data or {}))

    # Widgets get comms that publish (as in a kernel), whatever another test imported (ipykernel's
    # comms, outside a kernel, send nothing).
    monkeypatch.setattr(comm, "create_comm", lambda **args: comm.DummyComm(**args))
    monkeypatch.setattr(comm.DummyComm, "publish_msg", publish_msg)
    return sent


def test_many_ranks_updating_fast_stay_within_the_budget_and_every_row_still_moves(published):
    from distlab.dashboard.progress_view import ProgressView

    clock = published.clock
    config = ProgressConfig()

    def state(step: int) -> list:
        # 8 ranks, each an epoch bar and a step bar, publishing every 0.05 s: far more than may be drawn.
        return rows_of({
            rank: [_bar(0, step // 100, 4, "epoch"), _bar(1 + step // 100, step % 100, 100, "step")]
            for rank in range(8)
        })  # fmt: skip

    view = ProgressView(state(0), config, clock=lambda: clock[0])
    assert len(view.box.children) == 16 and view.messages == 0, "made with their values: no update sent"
    for step in range(1, 400):  # 20 s
        clock[0] = step * 0.05
        view.update(state(step))
    ours = {id(w.comm) for w in _all_widgets(view)}
    times = [t for t, c, _ in published if id(c) in ours]
    assert view.messages == len(times), "the budget counted what the widgets really sent"
    busiest = max(sum(1 for u in times if t <= u < t + 1.0) for t in times)
    assert busiest <= config.max_messages_per_s, busiest
    assert len(times) > 10 * config.max_messages_per_s, "the budget was used, not left idle"
    moved = {id(c) for _, c, data in published if "value" in data.get("state", {})}
    bars = [row.children[1] for row in view.box.children]
    assert all(id(b.comm) in moved for b in bars), "every rank's rows moved while the cell ran"

    view.update(state(399), force=True)  # whatever the budget: all of it
    assert [row.children[1].value for row in view.box.children] == [3, 99] * 8
    assert view.box.children[1].children[2].value.startswith("99/100 [")
    view.close()


def test_rows_come_and_go_with_the_bars_a_rank_shows(published):
    from distlab.dashboard.progress_view import ProgressView

    clock = published.clock
    view = ProgressView(rows_of({0: [_bar(0, 0, 3, "epoch")]}), clock=lambda: clock[0])
    clock[0] = 1.0
    assert view.update(rows_of({0: [_bar(0, 0, 3, "epoch"), _bar(1, 5, 10, "step")], 1: [_bar(0, 1, 3, "epoch")]}))
    assert [row.children[0].value for row in view.box.children] == ["rank 0 epoch", "rank 0 step", "rank 1 epoch"]
    clock[0] = 2.0
    assert view.update(rows_of({0: [_bar(0, 1, 3, "epoch")], 1: [_bar(0, 1, 3, "epoch")]}))  # leave=False: gone
    assert [row.children[0].value for row in view.box.children] == ["rank 0 epoch", "rank 1 epoch"]
    assert view.box.children[0].children[1].value == 1
    clock[0] = 3.0
    # A total that is not whole needs a FloatProgress: the row is made anew.
    assert view.update(rows_of({0: [_bar(0, 0.5, 2.5, "seconds")], 1: [_bar(0, 3, 3, "epoch", closed=True)]}))
    first, second = (row.children[1] for row in view.box.children)
    assert type(first).__name__ == "_FloatBar" and (first.value, first.max) == (0.5, 2.5)
    assert (second.value, second.bar_style) == (3, "success")
    clock[0] = 3.1
    assert not view.update(rows_of({0: [_bar(0, 1.0, 2.5, "seconds")]})), "too soon after the last redraw"
    view.close()


def _all_widgets(view: Any) -> list[Any]:
    rows = list(view.box.children)
    return [view.box, *rows, *(w for row in rows for w in row.children)]


# ------------------------------------------------------------------ the rank side, in this process


@pytest.fixture
def reporting() -> Iterator[list[tuple[float, dict]]]:
    """tqdm patched as on a rank (rank 2), its publishes recorded as (time, payload)."""
    import tqdm  # imported first: what uninstall puts back is tqdm's own
    import tqdm.auto

    from distlab.rank import progress

    sent: list[tuple[float, dict]] = []
    assert progress.install(2, send=lambda data: sent.append((time.monotonic(), data[PROGRESS_KEY])))
    try:
        yield sent
    finally:
        progress.uninstall()
        assert tqdm.tqdm.__module__ == "tqdm.std", "tqdm's own bar is back"


def _wait_for(condition: Any, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_rank_bar_writes_nothing_and_publishes_its_state_rate_limited(reporting, capfd):
    import tqdm
    import tqdm.auto
    import tqdm.notebook
    from tqdm.auto import tqdm as auto_tqdm

    from distlab.rank import progress

    assert auto_tqdm is tqdm.tqdm is tqdm.notebook.tqdm and issubclass(tqdm.tqdm, tqdm.std.tqdm)
    assert tqdm.std.tqdm.__module__ == "tqdm.std", "the base class stays tqdm's"
    start = time.monotonic()
    for _ in auto_tqdm(range(300), desc="train", mininterval=0):  # a redraw at every step
        time.sleep(0.002)
    _wait_for(lambda: reporting and reporting[-1][1]["bars"][0]["closed"], "the closed bar's publish")
    duration = time.monotonic() - start
    assert capfd.readouterr() == ("", ""), "the bar drew nothing on the rank"
    times = [t for t, _ in reporting]
    assert len(times) <= duration / progress.PUBLISH_INTERVAL_S + 2, (len(times), duration)
    assert all(b - a >= progress.PUBLISH_INTERVAL_S * 0.9 for a, b in itertools.pairwise(times))
    last = reporting[-1][1]
    seqs = [p["seq"] for _, p in reporting]
    assert last["rank"] == 2 and seqs == sorted(set(seqs)), "numbered in order, so the notebook keeps the latest"
    (bar,) = last["bars"]
    assert (bar["n"], bar["total"], bar["desc"], bar["closed"]) == (300, 300, "train", True)
    assert bar["rate"] and bar["rate"] > 0 and bar["elapsed"] > 0

    # The cell's end sends the final state again, then the next cell starts with no bars.
    count = len(reporting)
    progress.flush()
    assert len(reporting) == count + 1 and reporting[-1][1]["bars"][0]["n"] == 300
    progress.flush()
    assert len(reporting) == count + 1, "a cell that made no bar publishes nothing"


def test_nested_bars_inner_ones_that_do_not_stay_vanish_and_open_bars_are_sent_as_they_are(reporting):
    from tqdm import tqdm, trange

    from distlab.rank import progress

    outer = tqdm(total=3, desc="epoch")
    for _ in range(2):
        for _ in trange(10, desc="step", leave=False):
            pass
        outer.update(1)  # left open at 2 of 3, whether or not tqdm redrew it since
    for i in trange(5, desc="eval"):
        if i == 2:
            break
    for _ in trange(3, desc="quick", delay=60):  # done before its delay: tqdm never shows it
        pass
    progress.flush()
    bars = reporting[-1][1]["bars"]
    assert [(b["desc"], b["n"], b["total"], b["closed"]) for b in bars] == [
        ("epoch", 2, 3, False), ("eval", 2, 5, True),
    ]  # fmt: skip
    count = len(reporting)
    progress.flush()
    assert len(reporting) == count, "a bar left open is not shown by a cell that does not move it"
    # Bars a loop makes and leaves, beyond the few a rank shows, are dropped oldest first.
    for i in range(progress.MAX_BARS + 3):
        for _ in trange(2, desc=f"run {i}"):
            pass
    outer.update(1)
    progress.flush()
    bars = reporting[-1][1]["bars"]
    assert len(bars) == progress.MAX_BARS and bars[0]["desc"] == "epoch" and bars[0]["n"] == 3
    assert [b["desc"] for b in bars[1:]] == [f"run {i}" for i in range(4, progress.MAX_BARS + 3)]
    outer.close()


def test_outside_an_ipyparallel_engine_tqdm_is_left_as_it_is():
    import tqdm

    from distlab.rank import progress

    assert not progress.install(0) and not progress.installed()
    assert tqdm.tqdm is tqdm.std.tqdm


# ------------------------------------------------------------------ in a real kernel, on four ranks

_LOOP = """%%ddp
import time
{imports}
for step in {bar}:
    time.sleep(0.01)
"""


@pytest.fixture(scope="module")
def kernel() -> Iterator[Any]:
    """One kernel with a 4-rank lab for the module's kernel tests (starting them is slow)."""
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        execute(kc, "%load_ext distlab\n%dist start -n 4", timeout=180)
        yield kc
    finally:
        with contextlib.suppress(Exception):
            execute(kc, "%dist stop", timeout=60)
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def _run(kc: Any, code: str) -> list[dict]:
    messages: list[dict] = []
    execute(kc, code, timeout=180, messages=messages)
    return messages


def _sent_at(msg: dict) -> float:
    date = msg["header"]["date"]
    if isinstance(date, str):
        date = datetime.datetime.fromisoformat(date)
    return date.timestamp()


def _final_text(messages: list[dict]) -> list[str]:
    """The text the saved notebook keeps: the widget's display updated, or the text shown at the end."""
    final = [m for m in messages if m["msg_type"] in ("update_display_data", "display_data")]
    return final[-1]["content"]["data"]["text/plain"].splitlines()


def _nothing_drawn_on_the_ranks(messages: list[dict]) -> None:
    """No tqdm line on the ranks' streams, and no display but distlab's one (a rank's own would show too)."""
    texts = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert "%|" not in texts and "it/s" not in texts, texts
    assert [m["msg_type"] for m in messages].count("display_data") == 1


@pytest.mark.cluster
def test_tqdm_auto_on_four_ranks_is_one_live_widget_within_the_budget_that_ends_as_text(kernel):
    messages = _run(kernel, _LOOP.format(imports="from tqdm.auto import tqdm", bar="tqdm(range(200), desc='train')"))
    kinds = [m["msg_type"] for m in messages]
    bars = [
        m for m in messages
        if m["msg_type"] == "comm_open" and m["content"]["data"]["state"].get("_model_name") == "IntProgressModel"
    ]  # fmt: skip
    assert len(bars) == 4, "a bar per rank"
    shown = [m for m in messages if "application/vnd.jupyter.widget-view+json" in m["content"].get("data", {})]
    assert len(shown) == 1 and shown[0]["msg_type"] == "display_data", "one widget for the cell"
    assert kinds.count("update_display_data") == 1
    final_at = _sent_at(next(m for m in messages if m["msg_type"] == "update_display_data"))
    shown_at = _sent_at(shown[0])

    updates = [m for m in messages if m["msg_type"] == "comm_msg"]
    bar_ids = {m["content"]["comm_id"] for m in bars}
    live = [
        m["content"]["data"]["state"]["value"] for m in updates
        if m["content"]["comm_id"] in bar_ids and "value" in m["content"]["data"].get("state", {})
    ]  # fmt: skip
    assert any(0 < v < 200 for v in live), f"the bars moved while the cell ran: {live}"
    assert all(_sent_at(m) < final_at for m in updates), "every update came before the cell's end"
    times = sorted(_sent_at(m) for m in updates)
    config = ProgressConfig()
    busiest = max(sum(1 for u in times if t <= u < t + 1.0) for t in times)
    assert busiest <= config.max_messages_per_s, f"{busiest} widget messages in one second"
    assert len(times) <= config.max_messages_per_s * (final_at - shown_at + 1)
    print(f"\n200 steps x 4 ranks: {len(updates)} comm_msg over {final_at - shown_at:.1f} s, busiest second {busiest}")

    lines = _final_text(messages)
    assert len(lines) == 4, lines
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank} train: 100%|") and "200/200 [" in line, line
    final = next(m for m in messages if m["msg_type"] == "update_display_data")["content"]["data"]
    assert final["text/html"].count("<progress") == 4
    _nothing_drawn_on_the_ranks(messages)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "imports, bar",
    [
        ("from tqdm import tqdm", "tqdm(range(60))"),
        ("from tqdm.notebook import tqdm", "tqdm(range(60))"),
        ("from tqdm.autonotebook import trange", "trange(60)"),
        ("import tqdm", "tqdm.trange(60)"),
    ],
)
def test_every_way_of_importing_tqdm_draws_the_bars_in_the_notebook(kernel, imports, bar):
    messages = _run(kernel, _LOOP.format(imports=imports, bar=bar))
    lines = _final_text(messages)
    assert [line.split(":")[0] for line in lines] == [f"rank {r}" for r in range(4)], lines
    assert all("60/60 [" in line for line in lines), lines
    _nothing_drawn_on_the_ranks(messages)


@pytest.mark.cluster
def test_a_bar_on_rank_0_only_is_the_only_row_and_nested_bars_each_get_their_row(kernel):
    messages = _run(
        kernel, _LOOP.format(imports="from tqdm.auto import tqdm", bar="(tqdm(range(80)) if rank == 0 else range(80))")
    )
    (line,) = _final_text(messages)
    assert line.startswith("rank 0: 100%|") and "80/80" in line

    nested = """%%ddp
import time
from tqdm.auto import tqdm, trange
for epoch in trange(2, desc="epoch"):
    for step in tqdm(range(30), desc="step"):
        time.sleep(0.01)
    for step in tqdm(range(5), desc="eval", leave=False):
        pass
"""
    lines = _final_text(_run(kernel, nested))
    labels = [line.split(":")[0].strip() for line in lines]
    assert labels == [label for r in range(4) for label in (f"rank {r} epoch", f"rank {r} step", f"rank {r} step")]
    assert all(("2/2 [" if "epoch" in line else "30/30 [") in line for line in lines), lines


@pytest.mark.cluster
def test_lab_run_called_in_a_notebook_shows_the_bars_too_and_a_cell_without_tqdm_shows_nothing(kernel):
    code = (
        "from distlab.front.magics import current_lab\n"
        "current_lab().run('from tqdm import trange\\nfor i in trange(40): pass')"
    )
    lines = _final_text(_run(kernel, code))
    assert len(lines) == 4 and all("40/40" in line for line in lines), lines
    quiet = _run(kernel, "%%ddp\nx = sum(range(10))")
    assert not [m for m in quiet if m["msg_type"] in ("display_data", "update_display_data", "comm_open")]


@pytest.mark.cluster
def test_a_cell_that_fails_midway_leaves_each_rank_s_bar_where_it_stopped(kernel):
    code = """%%ddp
import time
from tqdm.auto import tqdm
for i in tqdm(range(100), desc="train"):
    if i == 30 + rank:
        raise ValueError("stop here")
    time.sleep(0.01)
"""
    shown: list[dict] = []
    reply = kernel.execute_interactive(code, timeout=180, output_hook=shown.append)
    assert reply["content"]["status"] == "error" and "stop here" in reply["content"]["evalue"]
    lines = _final_text(shown)
    assert [line.split(":")[0] for line in lines] == [f"rank {r} train" for r in range(4)], lines
    assert [line.split("| ")[1].split(" ")[0] for line in lines] == [f"{30 + r}/100" for r in range(4)], lines
