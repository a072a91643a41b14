"""What a network lesson measured on emulated nodes, saved with it, for a machine that cannot make nodes.

Where nodes cannot be made (no root, and user namespaces refused: ``cluster.namespaces`` says why in
one line), a network notebook runs its ranks on loopback: its times are then CPU copying, and there
is no link to count bytes on. So that its lesson is still there, each cell whose result needs the
links also shows what it printed in the run on nodes that the notebook was saved from, every line
marked as saved, not measured:

    saved = saved_from_nodes("12-network-lab")       # in the notebook's first cell
    ...
    if not on_nodes:
        saved("one node, two nodes")                  # in a cell whose result needs the links

The texts live in ``notebooks/saved/<notebook>.json``, taken by :func:`extract` from the saved
notebook's own outputs (``scripts/save-shaped-runs.py`` writes them; a test keeps the two equal), so
what is shown is exactly what that run printed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from ..errors import LabUsageError

__all__ = ["MARK", "extract", "saved_from_nodes", "saved_path"]

#: Every line shown from a saved run starts with this: it was not measured here.
MARK = "saved | "
_CALL = re.compile(r"""\bsaved\(\s*(["'])(.+?)\1\s*\)""")
_HEADER = "not measured here: what this cell printed in the run on emulated nodes this notebook was saved from"


def extract(notebook: str | os.PathLike[str]) -> dict[str, str]:
    """{key: the text a code cell printed} for each ``saved("key")`` in a saved notebook's cells."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    found: dict[str, str] = {}
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        for _, key in _CALL.findall("".join(cell["source"])):
            if key in found:
                raise LabUsageError(f"{notebook}: saved({key!r}) is in two cells: give each cell its own key")
            found[key] = "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])
                                 if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return found


def saved_path(notebook: str, folder: str | os.PathLike[str] | None = None) -> Path:
    """Where a notebook's saved texts are: ``saved/`` beside the notebooks (the kernel's folder when
    a notebook runs in Jupyter; else this checkout's ``notebooks/``)."""
    if folder is None:
        here = Path.cwd() / "saved"
        folder = Path.cwd() if here.is_dir() else Path(__file__).resolve().parents[2] / "notebooks"
    return Path(folder) / "saved" / f"{notebook}.json"


def saved_from_nodes(notebook: str, folder: str | os.PathLike[str] | None = None) -> Callable[[str], None]:
    """A function that prints what the cell keyed ``key`` printed on nodes, every line marked saved."""
    path = saved_path(notebook, folder)

    def saved(key: str) -> None:
        try:
            texts = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"no saved run to show ({path}: {exc.__class__.__name__})")
            return
        if key not in texts:
            raise LabUsageError(f"{path} has no saved cell {key!r}: it has {', '.join(map(repr, texts)) or 'none'}")
        print(_HEADER)
        for line in texts[key].rstrip("\n").splitlines():
            print(MARK + line)

    return saved
