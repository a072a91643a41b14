"""What a rank displays, the notebook shows: rich outputs, figures, tables and live widgets, in a real
kernel; and their text form where nothing renders them (a script, a terminal)."""

from __future__ import annotations

from typing import Any

import pytest
from _jupyter import execute
from conftest import rank_lines
from jupyter_client.manager import start_new_kernel

import distlab

pytestmark = pytest.mark.cluster

WIDGET = "application/vnd.jupyter.widget-view+json"

_CELL = """%%ddp
import time
from IPython.display import HTML, Markdown, display
display(HTML(f"<b>html from rank {rank}</b>"))
display(Markdown(f"*markdown from rank {rank}*"))
time.sleep(1.5)
print("printed after the displays")
"""

_FIGURE_AND_TABLE = """%%ddp -r 0
import matplotlib.pyplot as plt
import pandas as pd
plt.plot([0, 1, 4, 9])
plt.show()
display(pd.DataFrame({"rank": [rank], "loss": [0.5]}))
import plotly.graph_objects as go
go.Figure(go.Scatter(y=[3, 1, 2])).show()
"""

_WIDGET = """%%ddp -r 1
import time
import ipywidgets as w
slider = w.IntSlider(value=0, max=10, description=f"rank {rank}")
log = w.Output()
display(slider, log)
for step in range(1, 6):
    slider.value = step
    log.append_stdout(f"step {step}\\n")
    time.sleep(0.2)
print("model", slider.model_id, log.model_id)
"""


def _displays(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["content"]["data"] for m in messages if m["msg_type"] == "display_data"]


def _streams(messages: list[dict[str, Any]]) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")


def _position(messages: list[dict[str, Any]], found: Any) -> int:
    return next(i for i, m in enumerate(messages) if found(m))


def test_a_ranks_displays_figures_tables_and_widgets_appear_in_the_notebook_labelled_by_rank():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        execute(kc, "%load_ext distlab")
        execute(kc, "%dist start -n 2", timeout=120)

        messages: list[dict[str, Any]] = []
        execute(kc, _CELL, messages=messages)
        # Each rank's displays in the order it made them; ranks in rank order within a poll (a rank
        # whose display arrives a poll earlier is shown first: the cell streams, it does not wait).
        shown = [d.get("text/html") or d.get("text/markdown") for d in _displays(messages)]
        for rank in (0, 1):
            mine = [text for text in shown if text.endswith((f"from rank {rank}</b>", f"from rank {rank}*"))]
            assert mine == [f"<b>html from rank {rank}</b>", f"*markdown from rank {rank}*"], shown
        # Each display sits under its rank's label ...
        for rank in (0, 1):
            shown = _position(messages, lambda m, r=rank: f"html from rank {r}" in str(m["content"].get("data")))
            labels = [m for m in messages[:shown] if m["msg_type"] == "stream"]
            assert labels and labels[-1]["content"]["text"].rstrip().endswith(f"[rank {rank}]")
        # ... and was shown while the cell ran, before the ranks printed 1.5 s later.
        first_display = _position(messages, lambda m: m["msg_type"] == "display_data")
        after = _position(messages, lambda m: "printed after" in m["content"].get("text", ""))
        assert first_display < after

        messages = []
        execute(kc, _FIGURE_AND_TABLE, messages=messages)
        shown = _displays(messages)
        assert any("image/png" in d for d in shown), shown  # matplotlib's figure, as an image
        table = next(d for d in shown if "text/html" in d)
        assert "<table" in table["text/html"] and "loss" in table["text/html"]
        plotly = next(d["application/vnd.plotly.v1+json"] for d in shown if "application/vnd.plotly.v1+json" in d)
        assert plotly["data"][0]["type"] == "scatter"  # a plotly figure, for JupyterLab's plotly renderer
        assert "[rank 1]" not in _streams(messages)  # -r 0: rank 0's alone

        messages = []
        execute(kc, _WIDGET, messages=messages)
        view = next(d[WIDGET] for d in _displays(messages) if WIDGET in d)
        model_id = view["model_id"]
        assert f"model {model_id}" in _streams(messages)  # the widget the rank made, not a copy
        # Its model reached the front end, and its value moved live as the rank set it.
        opened = [m for m in messages if m["msg_type"] == "comm_open" and m["content"]["comm_id"] == model_id]
        assert opened and opened[0]["content"]["data"]["state"]["_model_name"] == "IntSliderModel"
        values = [
            m["content"]["data"]["state"]["value"]
            for m in messages
            if m["msg_type"] == "comm_msg"
            and m["content"]["comm_id"] == model_id
            and "value" in m["content"]["data"].get("state", {})
        ]
        assert values[-1] == 5 and len(values) >= 3, values
        # An Output widget the rank writes into fills in the front end too.
        log_id = next(d[WIDGET]["model_id"] for d in _displays(messages)[1:] if WIDGET in d)
        assert f"{model_id} {log_id}" in _streams(messages)
        written = [
            m["content"]["data"]["state"]["outputs"]
            for m in messages
            if m["msg_type"] == "comm_msg"
            and m["content"]["comm_id"] == log_id
            and "outputs" in m["content"]["data"].get("state", {})
        ]
        assert written and [o["text"] for o in written[-1]] == [f"step {i}\n" for i in range(1, 6)], written[-1:]
        assert execute(kc, "%%ddp\nprint(rank)").count("\n") == 2  # the lab goes on as before
    finally:
        km.shutdown_kernel(now=False)
        kc.stop_channels()


def test_outside_a_kernel_a_display_prints_its_text_and_the_result_keeps_it(lab, capsys):
    result = lab.run(
        "from IPython.display import HTML, display\n"
        "import ipywidgets as w\n"
        "display(HTML(f'<i>rank {rank}</i>'))\n"
        "display(w.IntSlider(value=rank))\n"
    )
    out = capsys.readouterr().out
    assert "[rank 0] <IPython.core.display.HTML object>" in out
    assert "[rank 1] IntSlider(value=1)  (a widget made on the rank: it shows only in a Jupyter notebook)" in out
    assert [o["data"]["text/html"] for o in result.outputs[1] if "text/html" in o["data"]] == ["<i>rank 1</i>"]
    assert WIDGET in result.outputs[0][1]["data"]


def test_a_widget_made_on_a_rank_in_a_terminal_ipython_leaves_the_lab_working(ipython, capsys):
    # ipyparallel relays a rank's widget messages only to a kernel; a terminal shell must not stop
    # the lab's output and telemetry from arriving afterwards.
    ipython.run_line_magic("dist", "start -n 2")
    ipython.run_cell_magic("ddp", "", "import ipywidgets as w\ndisplay(w.IntSlider(value=rank))")
    ipython.run_cell_magic(
        "ddp",
        "",
        "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "with distlab.watch(m):\n"
        "    for _ in range(3):\n"
        "        m(torch.ones(4, 2)).sum().backward()\n"
        "        opt.step()\n"
        "print('still here')",
    )
    out = capsys.readouterr().out
    assert "[rank 1] IntSlider(value=1)" in out and "[rank 1] still here" in rank_lines(out), out
    lab = distlab.current_lab()
    assert sorted({(r["rank"], r["step"]) for r in lab.telemetry.records()}) == [
        (r, s) for r in (0, 1) for s in range(3)
    ]
