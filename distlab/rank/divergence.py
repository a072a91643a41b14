"""Where replicas part: every op of one step hashed on every rank, the first op whose outputs differ.

    report = distlab.divergence(model, batch)   # in a %%ddp cell: every rank calls it
    print(report)    # the op, the module it ran in, the cell's line, and the module's state that differs

Checksums of the weights (``distlab.watch``) say *that* replicas differ; this says *where* they
start to. The batch is rank 0's on every rank (broadcast first), so every difference comes from the
replicas themselves: a parameter or a buffer (BatchNorm's running statistics, which DDP does not
average unless asked), random state, or code that depends on the rank. Each op torch runs in the
forward (and the backward, with ``backward=True``) is seen by a dispatch mode; its outputs are hashed
exactly (their bytes); the ranks' lists are gathered and compared op by op. The first op whose
outputs differ while every op before it agreed took different state: the module's parameters and
buffers that differ between ranks are named.

It runs the model as a step would (in its mode: BatchNorm in training mode updates its running
statistics; ``backward=True`` leaves gradients as the step made them); it takes no optimizer step.
Hashing copies every output: for the small models of a lesson, not for a large model's step.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import cast

import torch
import torch.distributed as dist

from ..errors import format_ranks
from ..wire import CELL_FILE
from .torchcompat import tree_leaves
from .torchcompat_dispatch import DispatchMode, Op, op_name

__all__ = ["Divergence", "divergence"]


@dataclass(frozen=True)
class _Op:
    name: str
    module: str
    line: int  # the cell's line it ran from (0: not from a cell)
    digest: str


@dataclass(frozen=True)
class Divergence:
    """The first op whose outputs differ between ranks (``parted``), or that none did."""

    ops: int  # ops compared (those every rank ran, up to the first difference)
    parted: bool = False
    index: int = -1  # the op's place in the step, from 0
    op: str = ""
    module: str = ""  # the module it ran in ("" for the top level), and its class
    line: int = 0
    source: str = ""  # the cell's line's text
    #: Ranks grouped by the outputs they computed for the op (the largest group first).
    groups: list[list[int]] = field(default_factory=list)
    #: The module's own parameters and buffers whose values differ between ranks.
    state: list[str] = field(default_factory=list)
    #: When the ranks did not even run the same ops: what each ran at ``index``.
    different_ops: dict[int, str] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.parted:
            return f"the replicas agree on every op of the step ({self.ops} ops compared)"
        where = f" in module {self.module}" if self.module else ""
        at = f", cell line {self.line}: {self.source}" if self.line else ""
        if self.different_ops:
            ran = "; ".join(f"rank {r} ran {op}" for r, op in sorted(self.different_ops.items()))
            return f"the ranks ran different ops at op #{self.index}{where}{at}: {ran}"
        groups = " vs ".join(f"ranks {format_ranks(g)}" if len(g) > 1 else f"rank {g[0]}" for g in self.groups)
        lines = [f"the replicas part at op #{self.index} of the step, {self.op}{where}{at}: {groups} "
                 f"(every op before it agreed)"]
        if self.state:
            lines.append(f"its module's state differs between ranks: {', '.join(self.state)}")
        return "\n".join(lines)


class _Recorder(DispatchMode):  # torch's TorchDispatchMode
    """Every op's outputs hashed, with the module it ran in and the cell's line."""

    def __init__(self, module_of: Callable[[], str]) -> None:
        cast("Callable[[], None]", super().__init__)()  # TorchDispatchMode's, unannotated in torch
        self.ops: list[_Op] = []
        self._module_of = module_of

    def __torch_dispatch__(
        self, func: Op, types: Sequence[type], args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None
    ) -> object:
        out = func(*args, **(kwargs or {}))
        digest = hashlib.blake2b(digest_size=16)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                data = leaf.detach()
                digest.update(str((data.dtype, tuple(data.shape))).encode())
                digest.update(_bytes(data))
            elif isinstance(leaf, (int, float, bool, str, type(None), torch.dtype, torch.device)):
                digest.update(repr(leaf).encode())
            else:  # an object (a profiler's record handle): its repr holds its address, not a value
                digest.update(type(leaf).__qualname__.encode())
        self.ops.append(_Op(op_name(func), self._module_of(), _cell_line(), digest.hexdigest()))
        return out


def _cell_line() -> int:
    """The line of the running cell this op was called from (0 if none)."""
    frame: FrameType | None = sys._getframe(2)
    prefix, suffix = CELL_FILE.split("{rank}")
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(prefix) and name.endswith(suffix):
            return int(frame.f_lineno)
        frame = frame.f_back
    return 0


def _bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's values, exactly (a 0-d tensor too, which cannot be viewed as bytes as it is)."""
    data = tensor.detach().contiguous().cpu().reshape(-1)
    return data.view(torch.uint8).numpy().tobytes() if data.numel() else b""


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.blake2b(_bytes(tensor), digest_size=16).hexdigest()


def divergence(model: torch.nn.Module, batch: object, backward: bool = False) -> Divergence:
    """One step of ``model`` on ``batch`` (rank 0's, on every rank), every op's output hashed and
    compared across the ranks of the default group: the first op whose outputs differ. Every rank
    calls it (it uses collectives) and gets the same report. ``backward=True``: the backward's ops too
    (the output summed to a scalar)."""
    if not dist.is_initialized():
        raise RuntimeError("distlab.divergence compares ranks: call it in a %%ddp cell, on every rank")
    batch = _from_rank_0(batch)
    inner = model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model
    names = {module: name for name, module in inner.named_modules()}
    stack: list[str] = []

    def enter(module: torch.nn.Module, _inputs: tuple[object, ...]) -> None:
        stack.append(_label(names[module], module))

    def leave(module: torch.nn.Module, _inputs: tuple[object, ...], _output: object) -> None:
        stack.pop()  # a forward hook's return value would replace the module's output: None

    hooks = []
    for module in names:
        hooks.append(module.register_forward_pre_hook(enter))
        hooks.append(module.register_forward_hook(leave))
    recorder = _Recorder(lambda: stack[-1] if stack else "")
    try:
        with recorder:
            out = model(*batch) if isinstance(batch, tuple) else model(batch)
            if backward:
                leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                # A tensor: sum's 0 only where nothing needs a gradient (AttributeError then, as before).
                cast(torch.Tensor, sum(t.float().sum() for t in leaves)).backward()
    finally:
        for hook in hooks:
            hook.remove()
    everyone: list[list[_Op]] = [[] for _ in range(dist.get_world_size())]  # each filled by all_gather_object
    dist.all_gather_object(everyone, recorder.ops)
    report = _first_difference(everyone)
    if report.parted and report.module and not report.different_ops:
        report = _with_state(report, inner, names)
    return report


def _from_rank_0(value: object) -> object:
    """Rank 0's batch, on every rank: its tensors broadcast (in tuples, lists and dicts too)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_from_rank_0(v) for v in value)
    if isinstance(value, dict):
        return {k: _from_rank_0(v) for k, v in value.items()}
    if not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    dist.broadcast(copy, src=0)
    return copy.requires_grad_(value.requires_grad)


def _label(name: str, module: torch.nn.Module) -> str:
    return f"{name} ({type(module).__name__})" if name else type(module).__name__


def _first_difference(everyone: list[list[_Op]]) -> Divergence:
    common = min(len(ops) for ops in everyone)
    for i in range(common):
        here = {rank: ops[i] for rank, ops in enumerate(everyone)}
        first = here[0]
        if len({op.name for op in here.values()}) > 1:
            return Divergence(i, True, i, first.name, first.module, first.line, _source(first.line),
                              different_ops={r: op.name for r, op in here.items()})
        by_digest: dict[str, list[int]] = {}
        for rank, op in here.items():
            by_digest.setdefault(op.digest, []).append(rank)
        if len(by_digest) > 1:
            groups = sorted(by_digest.values(), key=lambda g: (-len(g), g[0]))
            return Divergence(i + 1, True, i, first.name, first.module, first.line, _source(first.line), groups)
    if any(len(ops) != common for ops in everyone):
        ran = {r: (ops[common].name if len(ops) > common else "nothing (its step had ended)")
               for r, ops in enumerate(everyone)}
        return Divergence(common, True, common, different_ops=ran)
    return Divergence(common)


def _with_state(report: Divergence, inner: torch.nn.Module, names: dict[torch.nn.Module, str]) -> Divergence:
    """The diverging module's own parameters and buffers whose values differ between the ranks."""
    module = next((m for m, name in names.items() if _label(name, m) == report.module), None)
    if module is None:
        return report
    state = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    mine = {name: _digest(tensor) for name, tensor in state}
    everyone: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]  # filled by all_gather_object
    dist.all_gather_object(everyone, mine)
    differ = [name for name in mine if len({d.get(name) for d in everyone}) > 1]
    return Divergence(report.ops, True, report.index, report.op, report.module, report.line, report.source,
                      report.groups, differ)


def _source(line: int) -> str:
    """The running cell's line ``line`` (the cell's source is in linecache, as tracebacks read it)."""
    import linecache

    if not line:
        return ""
    rank = dist.get_rank()
    return linecache.getline(CELL_FILE.format(rank=rank), line).strip()
