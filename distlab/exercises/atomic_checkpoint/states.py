"""The two states each ``atomic-checkpoint`` case saves, and how a loaded checkpoint differs from one.

Both the grading rank and its saving process (``saver.py``) make them from the case alone, so only
the case travels between them, never megabytes of tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import torch

from ...rank.exercise import first_difference

__all__ = ["Case", "State", "TensorSpec", "difference", "mismatches", "state"]


class TensorSpec(TypedDict):
    """One tensor of a case's states."""

    name: str
    dtype: str  # a torch dtype's name: "bfloat16"
    shape: list[int]


class Case(TypedDict):
    """A case of ``atomic-checkpoint`` (as JSON, it also goes to the saving process)."""

    name: str
    kind: str  # "round trip" or "kills"
    tensors: list[TensorSpec]
    seed: int


#: A state a case saves: its tensors by name, and "step", "loss", "lr".
State = dict[str, torch.Tensor | float]


def state(case: Case, which: int) -> State:
    """State ``which`` (0 or 1) of the case: its tensors, in the case's dtypes, and three numbers."""
    gen = torch.Generator().manual_seed(case["seed"] * 2 + which)
    out: State = {"step": 1000 + which, "loss": 2.5 / (which + 3), "lr": 0.1 * (which + 1)}
    for spec in case["tensors"]:
        name, dtype_name, shape = spec["name"], spec["dtype"], spec["shape"]
        dtype = getattr(torch, dtype_name)
        if dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        elif dtype.is_floating_point or dtype.is_complex:
            exact = dtype in (torch.float32, torch.float64, torch.complex64)
            t = torch.randn(shape, generator=gen, dtype=dtype if exact else torch.float32).to(dtype)
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=gen, dtype=dtype)
        out[name] = t
    return out


def difference(got: object, expected: Mapping[str, object]) -> str | None:
    """None if ``got`` is ``expected`` exactly (same keys; tensors: dtype, shape, values; numbers: type, value)."""
    if not isinstance(got, Mapping):
        return f"load_checkpoint returned a {type(got).__name__}, expected the dict that was saved"
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected), key=str)
    if missing:
        return f"the key {missing[0]!r} is missing" + (f" ({len(missing)} missing)" if len(missing) > 1 else "")
    if extra:
        return f"there is a key {extra[0]!r} that was not saved"
    for key, want in expected.items():
        have = got[key]
        if isinstance(want, torch.Tensor):
            wrong = first_difference(have, want)
            if wrong is not None:
                return f"{key!r}: {wrong}"
        elif type(have) is not type(want) or have != want:
            return f"{key!r}: {have!r} ({type(have).__name__}), expected {want!r} ({type(want).__name__})"
    return None


def mismatches(got: Mapping[str, object], expected: Mapping[str, object]) -> int:
    return sum(difference({k: got.get(k)}, {k: v}) is not None for k, v in expected.items())
