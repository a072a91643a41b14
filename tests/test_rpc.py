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
    import subprocess
    import sys

    code = (
        "import sys, distlab; lab = distlab.Lab(ranks=2); import distlab.notebook.magics, distlab.notebook.recovery, distlab.exercises, distlab.exercises.cli; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'distlab.rank.')) "
        "and m != 'distlab.rank.dispatch'); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_release_request_is_named_alike_on_both_sides():
    # The notebook names the control message as text (it never imports the rank side).
    from distlab.notebook import release as notebook_side
    from distlab.rank import release as rank_side

    assert notebook_side.RELEASE_REQUEST == rank_side.RELEASE_REQUEST
