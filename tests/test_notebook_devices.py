"""Every `%%ddp` cell of the notebooks and the README puts its tensors and models on the rank's `device`.

On CPU ranks `device` is the CPU and a cell that forgets it still runs; on GPU ranks (NCCL) the same
cell fails. This reads the cells (tests/_devices.py says what it looks for) so that a forgotten
`device` fails here, on a machine without a GPU; the notebooks' run on GPU ranks is the `gpu` tests'.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _devices import findings, model_makers
from test_notebook_sources import read_source

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py"))


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)


def _ddp_cells(sources: list[str]) -> list[tuple[int, str]]:
    return [(i, s) for i, s in enumerate(sources) if s.lstrip().startswith("%%ddp")]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_each_notebook_cell_puts_its_tensors_and_models_on_device(source: Path) -> None:
    cells = [c.source for c in read_source(source).cells if c.cell_type == "code"]
    makers = model_makers(cells)
    found = [f"{source.name} cell {i}, {f}" for i, cell in _ddp_cells(cells) for f in findings(cell, makers)]
    assert not found, "\n".join(found)


def test_the_readme_examples_put_their_tensors_and_models_on_device() -> None:
    blocks = _readme_blocks()
    cells = _ddp_cells(blocks)
    assert cells, "the README shows no %%ddp cell: this test reads nothing"
    found = [f"README block {i}, {f}" for i, cell in cells for f in findings(cell, model_makers(blocks))]
    assert not found, "\n".join(found)


# --- the reading itself: what it must catch and what it must let be ----------------------------------

BAD = {
    "a factory": ("%%ddp\nx = torch.randn(4, 8)\n", "torch.randn(...) makes a CPU tensor"),
    "a layer": ("%%ddp\nm = DDP(torch.nn.Linear(8, 1))\n", "torch.nn.Linear(...) makes a model on the CPU"),
    "a class of the notebook": (
        (
            "%%ddp\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.fc = nn.Linear(2, 2)\nnet = Net()\n"
        ),
        "Net(...) makes a model on the CPU",
    ),
    "numpy": ("%%ddp\na = t.detach().numpy()\n", ".numpy() fails on a CUDA tensor"),
    "a CPU mesh": ('%%ddp\nmesh = init_device_mesh("cpu", (2,))\n', 'names the CPU'),
    "the CPU by name": ('%%ddp\nstage = PipelineStage(part, rank, 2, torch.device("cpu"))\n', 'names the CPU'),
    "the shipped GPT": ("%%ddp\nmodel = GPT(cfg)\n", "GPT(...) makes a model on the CPU"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_the_reading_names_what_stays_on_the_cpu(case: str) -> None:
    code, why = BAD[case]
    found = findings(code, model_makers([code]))
    assert len(found) == 1 and why in found[0].why, found


def test_a_function_of_the_notebook_that_returns_a_model_is_a_model() -> None:
    notebook = "def make_model():\n    torch.manual_seed(0)\n    return torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
    cell = "%%ddp\nmodel = make_model()\nother = make_model().to(device)\n"
    found = findings(cell, model_makers([notebook, cell]))
    assert [f.line for f in found] == [2] and "make_model" in found[0].why


def test_moved_made_on_device_nested_or_said_to_stay_on_the_cpu_is_fine() -> None:
    cell = (
        "%%ddp\n"
        "x = torch.randn(4, 8, device=device)\n"
        "y = torch.randn(4, 8, generator=g).to(device)\n"
        "m = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to(device))\n"
        "idx = torch.arange(10)            # indices into X, which is on the CPU\n"
        "a = t.cpu().numpy()\n"
        "mesh = init_device_mesh(device.type, (2,))\n"
        "%time z = 1\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(2, 2)   # moved with the model\n"
        "net = Net().to(device)\n"
    )
    assert findings(cell, model_makers([cell])) == []


def test_the_readme_training_example_runs_on_the_ranks_and_keeps_them_equal(lab) -> None:
    blocks = _readme_blocks()
    example = next(cell for _, cell in _ddp_cells(blocks) if "DDP(" in cell)
    body = example.split("\n", 1)[1]  # what follows the %%ddp line
    result = lab.run(body + "\n[round(p.sum().item(), 6) for p in model.parameters()]", stream=False)
    assert [line.split()[:2] for line in result.stdout[0].splitlines()] == [["step", "0"], ["step", "1"], ["step", "2"]]
    assert result[0] == result[1], "DDP's replicas differ after the README's steps"
    lab.run("del model, opt", stream=False)
