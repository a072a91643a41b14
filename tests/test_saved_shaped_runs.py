"""Network lessons where nodes cannot be made: each cell whose result needs the links shows, marked as
saved, what it printed in the run on nodes that its notebook was saved from (``distlab.notebook.saved``).

The saved texts must be exactly the saved notebook's own outputs (else a re-executed notebook would
show a stale run), and a notebook run where nodes are refused must show them, not fail.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.errors import LabUsageError
from distlab.notebook.saved import MARK, extract, saved_from_nodes

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
sys.path.insert(0, str(REPO / "scripts"))
save_script = __import__("save-shaped-runs")

USERS = save_script.users()
# Root without the network's capabilities and without CAP_SETFCAP, which may not map itself into a user
# namespace either: a machine where nodes cannot be made at all (test_nodes_without_root).
NO_NODES = ["setpriv", "--bounding-set=-net_admin,-sys_admin,-setfcap"]


def test_the_network_lessons_use_saved_runs() -> None:
    assert {"03-collectives-cost", "08-compression", "12-network-lab", "14-collectives",
            "19-two-tiers-hsdp", "21b-local-sgd-diloco"} <= set(USERS)


@pytest.mark.parametrize("name", sorted(USERS))
def test_the_saved_texts_are_the_saved_notebooks_own_outputs(name: str) -> None:
    texts = extract(USERS[name])
    committed = json.loads((NOTEBOOKS / "saved" / f"{name}.json").read_text())
    assert committed == texts, f"run scripts/save-shaped-runs.py {USERS[name].name} after re-executing it"
    assert texts and all(t.strip() and MARK not in t for t in texts.values())  # a run on nodes, every cell printed


def test_a_saved_cell_is_shown_marked_and_a_wrong_key_or_missing_file_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_from_nodes("12-network-lab", NOTEBOOKS)
    saved("hierarchical: checks")
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].startswith("not measured here")
    expected = json.loads((NOTEBOOKS / "saved" / "12-network-lab.json").read_text())["hierarchical: checks"]
    assert shown[1:] == [MARK + line for line in expected.splitlines()]
    with pytest.raises(LabUsageError, match="no saved cell 'hierarchicl'") as info:
        saved("hierarchicl")
    assert "\n" not in str(info.value)
    saved_from_nodes("12-network-lab", tmp_path)("hierarchical")
    assert capsys.readouterr().out.startswith("no saved run to show (")


def test_two_cells_with_one_key_are_refused(tmp_path: Path) -> None:
    cell = {"cell_type": "code", "source": ['saved("same")'], "outputs": [], "metadata": {}}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": [cell, cell]}))
    with pytest.raises(LabUsageError, match="in two cells"):
        extract(path)


@pytest.mark.cluster
def test_where_nodes_cannot_be_made_the_lesson_runs_on_loopback_and_shows_the_saved_run(tmp_path: Path) -> None:
    # As Binder without user namespaces would run it: nodes refused, every cell still runs.
    out = tmp_path / "14.ipynb"
    done = subprocess.run(
        [*NO_NODES, sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
         "--ExecutePreprocessor.timeout=300", f"--output={out}", str(NOTEBOOKS / "14-collectives.ipynb")],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cells = [c for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code"]

    def printed(cell: dict[str, object]) -> str:
        return "".join("".join(o.get("text", "")) for o in cell["outputs"])  # type: ignore[attr-defined]

    first = printed(cells[0])
    assert first.startswith("no emulated nodes here (") and "user namespace" in first
    saved_texts = json.loads((NOTEBOOKS / "saved" / "14-collectives.json").read_text())
    for key, text in saved_texts.items():
        cell = next(c for c in cells if re.search(rf"saved\(\"{re.escape(key)}\"\)", "".join(c["source"])))
        lines = printed(cell).splitlines()
        assert [MARK + line for line in text.splitlines()] == [x for x in lines if x.startswith(MARK)], key
