"""Every rank's RNG states (torch CPU and CUDA, python ``random``, numpy) as plain data, restored on
load, and the seed of a rank the checkpoint has no state for."""

from __future__ import annotations

import hashlib
import random
import sys
from typing import TypedDict

import torch

# ----------------------------------------------------------------------------------------------- rng


class PythonRngState(TypedDict):
    """``random.getstate()`` as plain data."""

    version: int
    internal: torch.Tensor
    gauss_next: float | None


class NumpyRngState(TypedDict):
    """``numpy.random.get_state()`` as plain data."""

    name: str
    keys: torch.Tensor
    pos: int
    has_gauss: int
    cached_gaussian: float


class _RngStateBase(TypedDict):
    torch: torch.Tensor
    python: PythonRngState


class RngState(_RngStateBase, total=False):
    """One process's RNG states (:func:`rng_state`): CUDA's where it was in use, numpy's where imported."""

    cuda: list[torch.Tensor]
    numpy: NumpyRngState


def rng_state() -> RngState:
    """This process's RNG states, as plain data (tensors, ints, floats, strings)."""
    version, internal, gauss_next = random.getstate()
    state: RngState = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never start CUDA just to save
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def restore_rng_state(state: RngState) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"][: torch.cuda.device_count()]
        for device, cuda_state in enumerate(states):
            torch.cuda.set_rng_state(cuda_state, device)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:  # saved where numpy was in use, loaded where it is not installed
            return
        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))


def derived_seed(step: int, rank: int) -> int:
    """A seed for a rank the checkpoint has no RNG state for: the same (step, rank) gives the same seed."""
    return int.from_bytes(hashlib.sha256(f"distlab:{step}:{rank}".encode()).digest()[:8], "little") >> 1


def reseed(seed: int) -> None:
    torch.manual_seed(seed)  # also every CUDA device
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)
