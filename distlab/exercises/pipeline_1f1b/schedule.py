"""The step as each stage ran it, and the pipeline its order makes.

While the learner's ``one_f_one_b`` runs, :class:`Recorder` wraps the stage's forward, autograd's
backward and the point-to-point calls of ``torch.distributed`` (``send``, ``isend``, ``recv``,
``irecv``, a request's ``wait``, ``barrier``): the stage's actions in order, as plain tuples,

    ("F", i) / ("B", i)                         forward / backward of micro-batch i
    ("post", handle, channel, seq, role)        a message posted: channel "0>1", "1>0" or "barrier"
    ("wait", handle)                            waiting for it (at once for send, recv and barrier)

and the time the stage spent computing. :func:`laid_out` lays the step out as both stages' orders
allow and no more: a forward takes one unit, a backward two (it computes two gradients), messages
none; an action starts once the one before it on its stage is done, and a wait ends once its message
is posted on both sides (gloo's send returns once the receive is posted). Its idle share is the
schedule's bubble, whatever the machine's load: 1F1B's order gives theory's ``(p-1)/(m+p-1)``
exactly, and an order that keeps a stage waiting longer (a message sent late) gives more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, ParamSpec, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from ...rank.torchcompat_c10d import point_to_point_functions, replaced_point_to_point

__all__ = ["NO_GRAD_INPUT", "Layout", "Recorder", "laid_out", "late_send"]

#: ("F", i) / ("B", i): forward / backward of micro-batch i.
Step = tuple[Literal["F", "B"], int]
#: ("post", handle, channel, seq, role): a message posted.
Post = tuple[Literal["post"], int, str, int, str]
#: ("wait", handle): waiting for a message.
Wait = tuple[Literal["wait"], int]
Action = Step | Post | Wait
#: What torch's send, recv, isend, irecv and barrier return.
_Returned = dist.Work | int | None

P = ParamSpec("P")
R = TypeVar("R")

NO_GRAD_INPUT = (
    "stage 1's input does not require a gradient, so stage 0 would get none: set requires_grad on the received "
    "activation and send its .grad back (x.requires_grad_() before stage 1's forward, then x.grad to stage 0 after "
    "the backward)"
)
_COST = {"F": 1, "B": 2}
_P2P = ("send", "recv", "isend", "irecv", "barrier")


def _set_backwards(tensor_backward: Callable[..., None], autograd_backward: Callable[..., None]) -> None:
    """Make ``tensor_backward`` torch's ``Tensor.backward`` and ``autograd_backward`` its ``autograd.backward``."""
    # setattr by name: mypy refuses assigning to a method of a class (what the watch is for).
    replaced = ((torch.Tensor, "backward", tensor_backward), (torch.autograd, "backward", autograd_backward))
    for owner, name, function in replaced:
        setattr(owner, name, function)


class Recorder:
    """Stage ``rank``'s actions and busy time while the learner's call runs (inside :meth:`watching`)."""

    def __init__(self, stage: nn.Module, rank: int) -> None:
        self.stage, self.rank = stage, rank
        self.actions: list[Action] = []
        self.busy_s = 0.0
        self._forwards = 0
        self._posted: dict[tuple[str, str], int] = {}

    def clear(self) -> None:
        self.actions.clear()
        self.busy_s, self._forwards = 0.0, 0
        self._posted.clear()

    @property
    def order(self) -> list[str]:
        """The forwards and backwards alone: ``["F0", "F1", "B0", ...]``."""
        return [f"{a[0]}{a[1]}" for a in self.actions if a[0] in _COST]

    @contextmanager
    def watching(self) -> Iterator[None]:
        module_forward = self.stage.forward
        self.stage.forward = self._forward(module_forward)
        backwards = torch.Tensor.backward, torch.autograd.backward
        _set_backwards(self._timed(backwards[0]), self._timed(backwards[1]))
        # Where torch looks them up itself too: P2POp checks its op against c10d's own isend and irecv.
        replaced = replaced_point_to_point(self._p2p(point_to_point_functions(_P2P)))
        try:
            with replaced:
                yield
        finally:
            del self.stage.forward
            _set_backwards(*backwards)

    def _forward(self, module_forward: Callable[..., R]) -> Callable[..., R]:
        def forward(*args: object, **kwargs: object) -> R:
            index = self._forwards
            self._forwards += 1
            if self.rank == 1 and torch.is_grad_enabled():
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                if tensors and not any(t.requires_grad for t in tensors):
                    raise RuntimeError(NO_GRAD_INPUT)
            began = time.perf_counter()
            out = module_forward(*args, **kwargs)
            self.busy_s += time.perf_counter() - began
            self.actions.append(("F", index))
            if isinstance(out, torch.Tensor) and out.requires_grad:
                # The gradient reaching this micro-batch's output: its backward through this stage begins.
                # torch leaves Tensor.register_hook unannotated: typed here as documented.
                register = cast("Callable[[Callable[[torch.Tensor], None]], object]", out.register_hook)

                def backward_begins(grad: torch.Tensor, index: int = index) -> None:
                    self.actions.append(("B", index))

                register(backward_begins)
            return out

        return forward

    def _timed(self, backward: Callable[P, R]) -> Callable[P, R]:
        depth = 0

        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            nonlocal depth
            depth += 1  # Tensor.backward calls torch.autograd.backward: time the outer call only
            began = time.perf_counter()
            try:
                return backward(*args, **kwargs)
            finally:
                depth -= 1
                if depth == 0:
                    self.busy_s += time.perf_counter() - began

        return run

    def _post(self, channel: str, role: str) -> int:
        seq = self._posted.get((channel, role), 0)
        self._posted[(channel, role)] = seq + 1
        handle = len(self.actions)
        self.actions.append(("post", handle, channel, seq, role))
        return handle

    def _p2p(self, original: Mapping[str, Callable[..., _Returned]]) -> dict[str, Callable[..., _Returned | _Request]]:
        # Two stages: every message goes to, or comes from, the other one.
        out, into = f"{self.rank}>{1 - self.rank}", f"{1 - self.rank}>{self.rank}"
        inside = False  # torch's recv is its irecv and a wait: a call within a call is the same message

        def run(name: str, *args: object, **kwargs: object) -> _Returned:
            nonlocal inside
            inside = True
            try:
                return original[name](*args, **kwargs)
            finally:
                inside = False

        def blocking(name: str, channel: str, role: str) -> Callable[..., _Returned | _Request]:
            def call(*args: object, **kwargs: object) -> _Returned | _Request:
                if inside:
                    return original[name](*args, **kwargs)
                if name == "barrier" and kwargs.get("async_op", args[1] if len(args) > 1 else False):
                    handle = self._post(channel, role)
                    work = run(name, *args, **kwargs)  # a Work: the barrier is asynchronous
                    return _Request(work, self, handle) if isinstance(work, dist.Work) else work
                self.actions.append(("wait", self._post(channel, role)))
                return run(name, *args, **kwargs)

            return call

        def posted(name: str, channel: str, role: str) -> Callable[..., _Returned | _Request]:
            def call(*args: object, **kwargs: object) -> _Returned | _Request:
                if inside:
                    return original[name](*args, **kwargs)
                handle = self._post(channel, role)
                work = run(name, *args, **kwargs)
                return _Request(work, self, handle) if isinstance(work, dist.Work) else work

            return call

        return {
            "send": blocking("send", out, "send"),
            "recv": blocking("recv", into, "recv"),
            "barrier": blocking("barrier", "barrier", str(self.rank)),
            "isend": posted("isend", out, "send"),
            "irecv": posted("irecv", into, "recv"),
        }


class _Request:
    """A request of isend or irecv (or an asynchronous barrier), telling the recorder when it is waited on."""

    def __init__(self, work: dist.Work, recorder: Recorder, handle: int) -> None:
        self._work, self._recorder, self._handle = work, recorder, handle

    def wait(self, *args: timedelta, **kwargs: timedelta) -> bool:  # Work.wait(timeout)
        self._recorder.actions.append(("wait", self._handle))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._work, name)


# ---------------------------------------------------------------------------- the step laid out


@dataclass(frozen=True)
class Layout:
    """The step laid out from the stages' orders: each stage's idle share, and the whole pipeline's."""

    idle: tuple[float, ...]
    whole: float


def _partners(channel: str, seq: int, stages: int) -> list[tuple[str, int, str]]:
    roles = [str(s) for s in range(stages)] if channel == "barrier" else ["send", "recv"]
    return [(channel, seq, role) for role in roles]


def laid_out(actions: list[list[Action]]) -> Layout | None:
    """The step as the stages' orders allow it (see the module's docstring); None if a message has no partner."""
    stages = len(actions)
    now, busy, position = [0.0] * stages, [0.0] * stages, [0] * stages
    posted: dict[tuple[str, int, str], float] = {}
    handles: dict[tuple[int, int], tuple[str, int]] = {}
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while position[s] < len(actions[s]):
                action = actions[s][position[s]]
                if action[0] in _COST:
                    now[s] += _COST[action[0]]
                    busy[s] += _COST[action[0]]
                elif action[0] == "post":
                    _, handle, channel, seq, role = action
                    posted[(channel, seq, role)] = now[s]
                    handles[(s, handle)] = (channel, seq)
                else:
                    times = [posted.get(key) for key in _partners(*handles[(s, action[1])], stages)]
                    if None in times:
                        break  # its partner is not posted yet: the other stage runs first
                    now[s] = max(now[s], *[t for t in times if t is not None])
                position[s] += 1
                moved = True
    step = max(now)
    if any(position[s] < len(actions[s]) for s in range(stages)) or step == 0:
        return None
    return Layout(tuple(1 - b / step for b in busy), 1 - sum(busy) / (stages * step))


def late_send(actions: list[list[Action]]) -> tuple[int, str] | None:
    """The first message a stage sent later than it could: (stage, what, in words), or None.

    Stage 0 sends micro-batch k's activation, made by its forward Fk; stage 1 its input's gradient,
    made by its backward Bk. A forward or backward run between the two keeps the other stage waiting.
    """
    for stage, own in enumerate(actions):
        made, what = ("F", "activation") if stage == 0 else ("B", "gradient")
        since: dict[int, list[str]] = {}  # micro-batch -> what the stage computed after making its tensor
        sent = 0
        for action in own:
            if action[0] in _COST:
                for later in since.values():
                    later.append(f"{action[0]}{action[1]}")
                if action[0] == made:
                    since[action[1]] = []
            elif action[0] == "post" and action[4] == "send":
                between = since.pop(sent, [])
                if between:
                    shown = ", ".join(between[:3]) + (f" and {len(between) - 3} more" if len(between) > 3 else "")
                    return (
                        stage,
                        f"stage {stage} sent {what} {sent} only after {shown}, keeping stage {1 - stage} waiting",
                    )
                sent += 1
    return None
