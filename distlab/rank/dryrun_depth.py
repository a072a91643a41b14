"""A deep stage's dry run from two shallow ones: the blocks of a transformer are alike, so what a rank
holds, moves and computes grows by the same amount with each block it holds.

The dry run (``rank/dryrun.py``) runs each op of a step under FakeTensor and four dispatch modes,
about 1,100 ops per block, each as slow at 70B's width as at a toy's. Here a stage of ``N`` blocks
is run with ``SHALLOW`` (4) and ``SHALLOW + 1`` blocks instead (the second in the same process,
with torch's caches warm), and each figure taken at ``N`` on the line through the two:

- additive figures (the bytes of parameters, gradients and the optimizer's states, what forward
  saves, each collective's calls, the FLOPs) are a constant (the embedding, the head, the root's FSDP
  unit) plus the same amount per block;
- a peak is not additive: it is the largest of the bytes alive at every op. The step is cut into
  segments at each block's forward (its pre-hook) and backward (the gradient of its output
  arriving), and each segment's own peak kept. The j-th block's segment at depth N holds what the
  blocks before it saved and the gradients of those after it: affine in j and N. So over the
  blocks in between, a segment's peak is largest at one of their ends, and the segments that can
  hold the step's peak at depth N are those of the first, second, second-to-last and last block of
  each phase, and the stretches before the first block (the embedding; the loss and head backward)
  and the optimizer's step: each a line in N, read from the two runs at the same position.

The method holds only where the blocks really are alike, and it checks what it can: at depth 5 the
three middle segments must lie on one line in j (else the full stage is run), the two runs must see
the same collectives, and the same segments. ``tests/test_scale_dryrun.py`` runs small plans both
ways and holds them equal to the byte, the call and the FLOP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ..scale.report import CollectiveJSON, MemoryJSON

__all__ = ["DEEP", "SHALLOW", "Measured", "Segments", "extrapolate", "position"]

#: The two depths run in place of a deep stage: the smallest at which the first, second,
#: second-to-last and last blocks are four different blocks, and one more.
SHALLOW = 4
#: The fewest blocks for which the two shallow runs are worth it: Llama 3 70B's three kinds of
#: stage took 21.1 s both ways at 10 blocks a stage (pp 8), 23.8 s against 36.6 s whole at 20 (pp 4).
DEEP = 12

Label = tuple[str, str]


class Measured(TypedDict):
    """One rank's step as the dry run measures it, before the pipeline's derivations."""

    memory: MemoryJSON
    collectives: list[CollectiveJSON]
    flops: int
    recomputed: int
    fp8: int  # of ``flops``, the fp8 matmuls'
    attention: int  # of ``flops``, attention's
    streamed: int  # bytes the other kernels of forward and backward read and write
    fused: int  # the same kernels' bytes when each chain of them between two matmuls is fused
    dtensor_ops: int  # ops DTensor dispatched
    segments: dict[str, int]  # "phase/position" -> that segment's peak bytes


def position(j: int, n: int) -> str:
    """Where the j-th of n blocks stands: the ends and their neighbours apart, the rest alike."""
    if j == 0:
        return "first"
    if j == n - 1:
        return "last"
    if j == 1:
        return "second"
    if j == n - 2:
        return "second-last"
    return f"middle {j}"


class Segments:
    """The step cut into segments at each block's forward and backward, each segment's peak bytes.

    ``observe(total)`` is called with the bytes alive after every op (``torchcompat_fake.memory_tracker``),
    ``phase(name)`` where the step's phase changes (forward, backward, optimizer)."""

    def __init__(self, blocks: Iterable[nn.Module]) -> None:
        self.label: Label = ("forward", "start")
        self.peaks: dict[str, int] = {}
        self._phase = "forward"
        self.blocks = list(blocks)
        n = len(self.blocks)
        self._hooks: list[RemovableHandle] = []
        for j, block in enumerate(self.blocks):
            where = position(j, n)
            self._hooks.append(block.register_forward_pre_hook(self._entering(where), prepend=True))
            self._hooks.append(block.register_forward_hook(self._leaving(where)))

    def _entering(self, where: str) -> Callable[[nn.Module, object], None]:
        def hook(module: nn.Module, args: object) -> None:
            if self._phase == "forward":  # not a checkpointed block run again in backward
                self.label = ("forward", where)
        return hook

    def _leaving(self, where: str) -> Callable[[nn.Module, object, object], None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            if self._phase == "forward" and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._backward(where))
        return hook

    def _backward(self, where: str) -> None:
        self.label = ("backward", where)

    def phase(self, name: str) -> None:
        self._phase, self.label = name, (name, "start")

    def observe(self, total: int) -> None:
        key = "/".join(self.label)
        if total > self.peaks.get(key, -1):
            self.peaks[key] = total

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()


def _line(a: int, b: int, at: int) -> int:
    """The value at depth ``at`` on the line through ``a`` at depth SHALLOW and ``b`` one block deeper."""
    return a + (at - SHALLOW) * (b - a)


def _middle_is_affine(deeper: dict[str, int]) -> bool:
    """At depth SHALLOW + 1, the second, middle and second-to-last blocks' segments lie on one line."""
    for phase in ("forward", "backward"):
        second, middle, last = (deeper.get(f"{phase}/{p}") for p in ("second", "middle 2", "second-last"))
        if second is None or middle is None or last is None or second + last != 2 * middle:
            return False
    return True


def extrapolate(shallow: Measured, deeper: Measured, depth: int) -> Measured | None:
    """The step at ``depth`` blocks from runs at SHALLOW and SHALLOW + 1, or None where the two do not
    show alike blocks (the caller then runs the whole stage)."""
    if not _middle_is_affine(deeper["segments"]):
        return None
    ends = {k: v for k, v in deeper["segments"].items() if not k.endswith("middle 2")}
    if set(ends) != set(shallow["segments"]):
        return None
    segments = {k: _line(shallow["segments"][k], ends[k], depth) for k in ends}
    keys = [(c["op"], c["dim"], c["group_size"], c["bytes"], c["phase"]) for c in shallow["collectives"]]
    if keys != [(c["op"], c["dim"], c["group_size"], c["bytes"], c["phase"]) for c in deeper["collectives"]]:
        return None
    collectives: list[CollectiveJSON] = [
        {**a, "calls_per_micro_batch": _line(a["calls_per_micro_batch"], b["calls_per_micro_batch"], depth)}
        for a, b in zip(shallow["collectives"], deeper["collectives"], strict=True)
    ]
    m0, m1 = shallow["memory"], deeper["memory"]
    held = {k: _line(m0[k], m1[k], depth) for k in ("parameters", "gradients", "optimizer", "saved")}
    forward_backward = max(v for k, v in segments.items() if not k.startswith("optimizer"))
    states = held["parameters"] + held["optimizer"]
    memory: MemoryJSON = {
        "parameters": held["parameters"], "gradients": held["gradients"], "optimizer": held["optimizer"],
        "activations": forward_backward - states, "peak": max(segments.values()), "saved": held["saved"],
    }
    return {"memory": memory, "collectives": collectives, "segments": segments,
            "flops": _line(shallow["flops"], deeper["flops"], depth),
            "recomputed": _line(shallow["recomputed"], deeper["recomputed"], depth),
            "fp8": _line(shallow["fp8"], deeper["fp8"], depth),
            "attention": _line(shallow["attention"], deeper["attention"], depth),
            "streamed": _line(shallow["streamed"], deeper["streamed"], depth),
            "fused": _line(shallow["fused"], deeper["fused"], depth),
            "dtensor_ops": _line(shallow["dtensor_ops"], deeper["dtensor_ops"], depth)}
