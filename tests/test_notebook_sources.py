"""The tutorial notebooks and their text sources agree.

notebooks/NN-name.ipynb (executed, outputs saved, what learners open and nbval runs) is paired by
notebooks/jupytext.toml with notebooks/src/NN-name.py (jupytext's percent format, what people review
and edit). Here, with jupytext's own pairing and reading: every notebook has its source and every
source its notebook, both hold the same cells (types, sources, tags), nbval's markers are cell tags
only, and no cell keeps run timestamps. Files are only read: nothing is started or executed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import jupytext
import nbformat
import pytest
from jupytext.config import load_jupytext_config
from jupytext.paired_paths import paired_paths
from nbval.plugin import find_comment_markers, metadata_tags

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOK_PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
# What a notebook run leaves on cells (nbclient's timings, the classic Notebook's ExecuteTime).
RUN_METADATA = ("execution", "ExecuteTime")
NUMBERED = re.compile(r"(\d\d)([b-z]?)-")
SITTINGS = "bcdefghijklmnopqrstuvwxyz"  # after NN-name: NNb-name, NNc-name, ...


def paired_source(ipynb: Path) -> Path:
    """The text file jupytext pairs with this notebook (by the jupytext.toml above it)."""
    config = load_jupytext_config(str(ipynb))
    assert config is not None, f"no jupytext configuration found for {ipynb}"
    formats = config.default_formats(str(ipynb))
    assert formats, f"jupytext's configuration pairs {ipynb} with nothing"
    texts = [Path(path) for path, fmt in paired_paths(str(ipynb), "ipynb", formats) if fmt["extension"] != ".ipynb"]
    assert len(texts) == 1, texts
    return texts[0]


def read_source(path: Path) -> nbformat.NotebookNode:
    """The notebook that `jupytext --sync` makes of a text source."""
    return jupytext.read(path, fmt="py:percent", config=load_jupytext_config(str(path)))


def _cell(cell: nbformat.NotebookNode) -> tuple[str, str, list[str]]:
    return cell.cell_type, cell.source, list(cell.metadata.get("tags", []))


def differences(ipynb: Path, source: Path) -> list[str]:
    """Where the notebook's cells and its text source's cells disagree; empty when they agree."""
    notebook = [_cell(c) for c in nbformat.read(ipynb, as_version=4).cells]
    text = [_cell(c) for c in read_source(source).cells]
    found = []
    for i, (a, b) in enumerate(zip(notebook, text)):
        for what, x, y in zip(("type", "source", "tags"), a, b):
            if x != y:
                found.append(f"cell {i}: {what} {x!r} in {ipynb.name}, {y!r} in {source.name}")
    if len(notebook) != len(text):
        found.append(f"{len(notebook)} cells in {ipynb.name}, {len(text)} in {source.name}")
    return found


def comment_markers(nb: nbformat.NotebookNode) -> list[str]:
    """Cells whose source holds a comment nbval acts on (# NBVAL_CHECK_OUTPUT and the like)."""
    return [f"cell {i}: {cell.source.splitlines()[0]!r}" for i, cell in enumerate(nb.cells)
            if list(find_comment_markers(cell.source))]


def unpaired(folder: Path) -> list[str]:
    """Notebooks in folder without their text source, and sources (or notebooks) under it paired with none."""
    sources = {paired_source(ipynb): ipynb for ipynb in sorted(folder.glob("*.ipynb"))}
    found = [f"{ipynb.name} has no {source.relative_to(folder)}" for source, ipynb in sources.items()
             if not source.is_file()]
    for path in sorted(p for ext in ("*.py", "*.ipynb") for p in folder.rglob(ext)):
        if ".ipynb_checkpoints" in path.parts or path in sources or path in sources.values():
            continue
        found.append(f"{path.relative_to(folder)} is paired with no notebook")
    return found


def test_the_notebooks_are_numbered_from_00_without_gaps() -> None:
    # NN-name; a lesson split into sittings goes on in NNb-name, NNc-name (14-collectives, 14b-dtensor-...)
    numbered = [NUMBERED.match(p.name) for p in NOTEBOOK_PATHS]
    assert [p.name for p, m in zip(NOTEBOOK_PATHS, numbered) if m is None] == []
    sittings = [(int(m[1]), m[2]) for m in numbered if m]
    numbers = sorted({n for n, _ in sittings})
    assert len(numbers) >= 12 and numbers == list(range(len(numbers)))
    assert sittings == [(n, part) for n in numbers
                        for part in ["", *SITTINGS][: sum(m == n for m, _ in sittings)]]


def test_every_notebook_has_a_text_source_and_every_source_a_notebook() -> None:
    assert unpaired(NOTEBOOKS) == [], "run: jupytext --sync notebooks/*.ipynb (or delete what is left over)"


@pytest.mark.parametrize("ipynb", NOTEBOOK_PATHS, ids=lambda p: p.stem)
def test_each_notebook_holds_the_cells_of_its_text_source(ipynb: Path) -> None:
    assert differences(ipynb, paired_source(ipynb)) == [], f"run: jupytext --sync {paired_source(ipynb)}"


@pytest.mark.parametrize("ipynb", NOTEBOOK_PATHS, ids=lambda p: p.stem)
def test_nbval_markers_are_tags_and_never_comments(ipynb: Path) -> None:
    notebook = nbformat.read(ipynb, as_version=4)
    assert comment_markers(notebook) == []
    assert comment_markers(read_source(paired_source(ipynb))) == []
    assert "NBVAL_" not in paired_source(ipynb).read_text(encoding="utf-8")
    tags = [tag for cell in notebook.cells for tag in cell.metadata.get("tags", [])]
    # A misspelt tag would silently compare nothing; every notebook compares some of its outputs.
    assert [t for t in tags if t not in metadata_tags] == []
    assert "nbval-check-output" in tags


@pytest.mark.parametrize("ipynb", NOTEBOOK_PATHS, ids=lambda p: p.stem)
def test_no_cell_keeps_run_timestamps_and_no_notebook_keeps_widget_state(ipynb: Path) -> None:
    notebook = nbformat.read(ipynb, as_version=4)
    nbformat.validate(notebook)
    assert [(i, key) for i, cell in enumerate(notebook.cells) for key in RUN_METADATA if key in cell.metadata] == []
    assert "widgets" not in notebook.metadata


def test_the_checks_catch_a_source_edited_but_not_synced_and_a_missing_pair(tmp_path: Path) -> None:
    folder = tmp_path / "notebooks"
    folder.mkdir()
    shutil.copy(NOTEBOOKS / "jupytext.toml", folder)
    ipynb = Path(shutil.copy(NOTEBOOKS / "00-start-here.ipynb", folder))
    source = paired_source(ipynb)
    assert source == folder / "src" / "00-start-here.py"
    source.parent.mkdir()
    shutil.copy(paired_source(NOTEBOOKS / ipynb.name), source)
    assert differences(ipynb, source) == [] and unpaired(folder) == []

    text = source.read_text(encoding="utf-8")
    header = '# %% tags=["nbval-check-output"]\n'
    cells = read_source(source).cells
    at = next(i for i, cell in enumerate(cells) if "nbval-check-output" in cell.metadata.get("tags", []))

    def edited(new: str) -> list[str]:
        source.write_text(text.replace(header, new, 1), encoding="utf-8")
        return differences(ipynb, source)

    # A line of code added; the tag dropped; nbval's old comment marker put back.
    [changed] = edited(header + "x = 1\n")
    assert changed.startswith(f"cell {at}: source ") and "'x = 1\\n" in changed
    assert edited("# %%\n") == [f"cell {at}: tags ['nbval-check-output'] in {ipynb.name}, [] in {source.name}"]
    assert [d.startswith(f"cell {at}: source ") for d in edited(header + "# NBVAL_CHECK_OUTPUT\n")] == [True]
    assert [m.split(":")[0] for m in comment_markers(read_source(source))] == [f"cell {at}"]
    # A cell added at the end.
    source.write_text(text + '\n# %%\nprint("one more cell")\n', encoding="utf-8")
    assert differences(ipynb, source) == [f"{len(cells)} cells in {ipynb.name}, {len(cells) + 1} in {source.name}"]

    # A source without its notebook, then a notebook without its source.
    ipynb.rename(tmp_path / ipynb.name)
    assert unpaired(folder) == ["src/00-start-here.py is paired with no notebook"]
    (tmp_path / ipynb.name).rename(ipynb)
    source.unlink()
    assert unpaired(folder) == ["00-start-here.ipynb has no src/00-start-here.py"]
