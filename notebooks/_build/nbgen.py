"""Tiny helper the make_NN.py scripts share: a notebook from a list of markdown and code cells.

    from nbgen import md, code, write
    write("01-data-parallelism.ipynb", [md("# title"), code("%load_ext distlab")])

``code(..., check=True)`` puts ``# NBVAL_CHECK_OUTPUT`` on the cell's first line, so nbval (run with
--nbval-lax) compares its output with the saved one. Execute the notebook afterwards with
``run.sh NN`` to store its outputs.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
NOTEBOOKS = HERE.parent


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str, check: bool = False, raises: bool = False):
    """A code cell; ``check``: nbval compares its output; ``raises``: it is meant to fail (the cell's
    ``raises-exception`` tag lets both nbconvert and nbval go on; nbval warns if a comment marker
    says the same, so there is none)."""
    source = textwrap.dedent(text).strip("\n")
    markers = ["# NBVAL_CHECK_OUTPUT"] if check else []
    if markers:
        lines = source.split("\n")
        # A cell magic must stay on the first line; the marker goes right after it.
        at = 1 if lines[0].startswith("%%") else 0
        lines[at:at] = markers
        source = "\n".join(lines)
    cell = new_code_cell(source)
    if raises:
        cell.metadata["tags"] = ["raises-exception"]
    return cell


def write(name: str, cells: list) -> Path:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    path = NOTEBOOKS / name
    nbformat.write(nb, path)
    return path
