"""The notebook's calls to the ranks name real rank-side functions with the same parameters."""

from __future__ import annotations

import importlib
import inspect

import pytest

from distlab.notebook import rpc


def _parameters(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


@pytest.mark.parametrize("wrapper", sorted(rpc.RANK_FUNCTIONS))
def test_each_call_names_a_rank_function_with_the_same_parameters(wrapper):
    module, name = rpc.RANK_FUNCTIONS[wrapper]
    target = getattr(importlib.import_module(f"distlab.rank.{module}"), name)
    assert _parameters(getattr(rpc, wrapper))[1:] == _parameters(target)


def test_every_rank_function_the_notebook_calls_has_a_wrapper_and_is_exported():
    for wrapper, (module, name) in rpc.RANK_FUNCTIONS.items():
        assert wrapper in rpc.__all__
        assert name in importlib.import_module(f"distlab.rank.{module}").__all__


@pytest.mark.cluster
def test_the_notebook_side_never_imports_torch_or_the_rank_side():
    from conftest import python_lines

    # A whole lab's life in the notebook's process: start, cells, a watched model, an exercise's
    # check, restart, stop. torch never loads there, so CUDA cannot be initialised before the ranks
    # start (a CUDA context made before starting processes breaks them on a GPU machine).
    code = (
        "import sys, distlab\n"
        "import distlab.front.magics, distlab.notebook.recovery, distlab.exercises, distlab.exercises.cli\n"
        "with distlab.start(ranks=2) as lab:\n"
        "    lab.run('m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1)); w = distlab.watch(m)\\n'\n"
        "            'm(torch.ones(3, 2)).sum().backward()', stream=False)\n"
        "    lab.run(distlab.exercises.get('average-gradients').solution(), stream=False)\n"
        "    assert distlab.exercises.check('average-gradients', lab, record=False).passed\n"
        "    lab.restart()\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'distlab.rank.')) "
        "and m != 'distlab.rank.dispatch'); print(bad, 'plotly' in sys.modules)\n"
    )
    printed = python_lines(code, timeout_s=600)
    # Nor, outside a kernel (nothing can show a dashboard there), the dashboard's plotting modules.
    assert printed[-1] == "[] False", printed
