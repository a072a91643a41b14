"""Calls from the notebook to the ranks: the one module that names rank-side functions.

Each function here sends one call to one engine (or a view of several) and returns ipyparallel's
``AsyncResult``, typed as ``Pending[T]``: what its ``get`` returns is the rank-side function's
result, as ``wire`` declares it; its parameters after ``target`` are exactly those of the rank-side function it
names in ``RANK_FUNCTIONS`` (``tests/test_rpc.py`` holds the two together, so a rename or a
changed signature fails a test, not a lab). The rank side is named as text so that the notebook
never imports it: it imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from .. import ipycompat
from ..rank.dispatch import on_rank
from ..wire import Breakpoint, CellReply, CollectiveEntry, EngineIdentity, GroupSpec, ProfileTrace, RankJoined

__all__ = [
    "RANK_FUNCTIONS",
    "Engine",
    "Pending",
    "RankTarget",
    "abort_group",
    "arm_pause",
    "case_names",
    "check_group",
    "collective_trace",
    "describe",
    "grade_case",
    "init_rank",
    "join_as_replacement",
    "open_store",
    "pack_definitions",
    "postmortem",
    "profile_trace",
    "rebuild_group",
    "run_cell",
    "run_script",
    "serve_release",
    "share_state",
    "start_profile",
]

#: wrapper name -> (module under ``distlab.rank``, function name there).
RANK_FUNCTIONS: dict[str, tuple[str, str]] = {
    "describe": ("identity", "describe"),
    "open_store": ("group", "open_store"),
    "init_rank": ("group", "init_rank"),
    "join_as_replacement": ("group", "join_as_replacement"),
    "share_state": ("heal", "share_state"),
    "rebuild_group": ("group", "rebuild_group"),
    "check_group": ("group", "check_group"),
    "abort_group": ("group", "abort_group"),
    "serve_release": ("release", "serve_release"),
    "arm_pause": ("pause", "arm"),
    "collective_trace": ("flight", "collective_trace"),
    "run_cell": ("cell", "run_cell"),
    "run_script": ("cell", "run_script"),
    "postmortem": ("postmortem", "describe"),
    "pack_definitions": ("exercise", "pack_definitions"),
    "case_names": ("exercise", "case_names"),
    "grade_case": ("exercise", "grade_case"),
    "start_profile": ("profiling", "start_profile"),
    "profile_trace": ("profiling", "profile_trace"),
}


T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """ipyparallel's ``AsyncResult`` of one rank-side call, as the notebook uses it: ``get`` gives
    the call's result (typed), the rest is what a running cell reads while it waits."""

    def get(self, timeout: float | None = None) -> T_co: ...
    def ready(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def wait_for_output(self, timeout: float = -1) -> bool: ...

    @property
    def data(self) -> Any: ...
    @property
    def stdout(self) -> str: ...
    @property
    def stderr(self) -> str: ...
    @property
    def outputs(self) -> list[dict[str, Any]]: ...


class RankTarget(Protocol):
    """Where a rank-side call goes: ``client[engine_id]`` (ipyparallel's ``DirectView``) or an
    :class:`Engine`; ``apply_async`` gives the call's ``AsyncResult`` (a :class:`Pending`)."""

    def apply_async(self, f: Callable[..., Any], *args: Any) -> Any: ...


def _call(target: RankTarget, wrapper: str, *args: Any) -> Any:
    module, name = RANK_FUNCTIONS[wrapper]
    return target.apply_async(on_rank, (module, name, args))


class Engine:
    """One engine, to send calls to as to ``client[engine_id]``: ``apply_async(f, *args)`` gives
    the same ``AsyncResult``, without the DirectView's bookkeeping.

    A cell's calls go through this. ``DirectView.apply_async`` binds each call's signature twice
    (its two decorators), keeps the view's history and outstanding sets, and resolves the target
    anew: on an empty ``%%ddp`` cell at 2 ranks that was ~2 ms of the kernel's main thread, more
    than ``%%px``'s whole send. What is left is ipyparallel's own documented step, ``Client.
    send_apply_request``, to the socket and engine identity the DirectView would use.
    """

    def __init__(self, client: ipycompat.IppClient, engine_id: int) -> None:
        self._socket, self._ident, self._targets = ipycompat.engine_send_target(client, engine_id)
        self._client = client
        self.engine_id = engine_id

    def apply_async(self, f: Callable[..., Any], *args: Any) -> Any:
        from ipyparallel.client.asyncresult import AsyncResult

        future = self._client.send_apply_request(
            self._socket, _pickled(f), args, {}, metadata={"label": None}, ident=self._ident
        )
        return AsyncResult(self._client, future, fname=f.__name__, targets=self._targets, owner=True)


_PICKLED: dict[Any, Any] = {}


def _pickled(f: Any) -> Any:
    """``f`` pickled once for every call that sends it (ipyparallel's ``PrePickled``, as a view
    uses for one call to several engines); the only ``f`` sent is ``on_rank``."""
    pickled = _PICKLED.get(f)
    if pickled is None:
        from ipyparallel.serialize import PrePickled

        pickled = _PICKLED[f] = PrePickled(f)
    return pickled


def describe(target: RankTarget, controller_ip: str) -> Pending[list[EngineIdentity]]:
    """What each engine of a view says of itself (``rank.identity.describe``)."""
    return cast("Pending[list[EngineIdentity]]", _call(target, "describe", controller_ip))


def open_store(target: RankTarget, host: str, timeout_s: float) -> Pending[int]:
    """On rank 0's engine: the rendezvous store's port."""
    return cast("Pending[int]", _call(target, "open_store", host, timeout_s))


def init_rank(target: RankTarget, spec: GroupSpec) -> Pending[RankJoined]:
    return cast("Pending[RankJoined]", _call(target, "init_rank", spec))


def join_as_replacement(target: RankTarget, spec: GroupSpec) -> Pending[RankJoined]:
    """On a new engine taking a dead rank's place while a healing cell runs (``rank.group``)."""
    return cast("Pending[RankJoined]", _call(target, "join_as_replacement", spec))


def share_state(target: RankTarget, src: int) -> Pending[bool | None]:
    """On every rank after a healing cell with a replacement (``rank.heal.share_state``)."""
    return cast("Pending[bool | None]", _call(target, "share_state", src))


def rebuild_group(target: RankTarget, master_port: int) -> Pending[RankJoined]:
    return cast("Pending[RankJoined]", _call(target, "rebuild_group", master_port))


def check_group(target: RankTarget, timeout_s: float) -> Pending[str]:
    """-> "ok", or why the group cannot complete a tiny all-reduce."""
    return cast("Pending[str]", _call(target, "check_group", timeout_s))


def abort_group(target: RankTarget) -> Pending[bool]:
    """-> whether the rank had a group to tear down."""
    return cast("Pending[bool]", _call(target, "abort_group"))


def arm_pause(target: RankTarget, spec: Breakpoint) -> Pending[None]:
    """Stop the rank's next cell before the collective ``spec`` names (``rank.pause.arm``)."""
    return cast("Pending[None]", _call(target, "arm_pause", spec))


def serve_release(target: RankTarget) -> Pending[None]:
    """The rank answers ``wire.RELEASE_REQUEST`` on its control channel from now on."""
    return cast("Pending[None]", _call(target, "serve_release"))


def collective_trace(target: RankTarget, last: int) -> Pending[list[CollectiveEntry]]:
    return cast("Pending[list[CollectiveEntry]]", _call(target, "collective_trace", last))


def run_cell(target: RankTarget, code: str, rank: int, want: str) -> Pending[CellReply]:
    return cast("Pending[CellReply]", _call(target, "run_cell", code, rank, want))


def run_script(target: RankTarget, text: str, path: str, argv: list[str], rank: int) -> Pending[CellReply]:
    """The script run as ``__main__`` with ``sys.argv = argv`` (``%dist run``)."""
    return cast("Pending[CellReply]", _call(target, "run_script", text, path, argv, rank))


def postmortem(target: RankTarget, max_frames: int, max_locals: int) -> Pending[dict[str, Any] | None]:
    """-> the rank's kept failure (its frames, their locals summarised) as plain data, or None."""
    return cast("Pending[dict[str, Any] | None]", _call(target, "postmortem", max_frames, max_locals))


def pack_definitions(target: RankTarget, names: list[str]) -> Pending[CellReply]:
    """A reply whose value is ``{"blob": bytes}``, ``{"missing": [...]}`` or ``{"unpicklable": why}``."""
    return cast("Pending[CellReply]", _call(target, "pack_definitions", names))


def case_names(target: RankTarget, exercise: str, world_size: int, seed: int) -> Pending[CellReply]:
    """A reply whose value is the names of the exercise's cases at ``world_size``."""
    return cast("Pending[CellReply]", _call(target, "case_names", exercise, world_size, seed))


def grade_case(target: RankTarget, exercise: str, blob: bytes, seed: int, index: int, rank: int) -> Pending[CellReply]:
    """A reply whose value is the rank's outcome of one case (``rank.exercise.passed``/``failed``)."""
    return cast("Pending[CellReply]", _call(target, "grade_case", exercise, blob, seed, index, rank))


def start_profile(target: RankTarget, steps: int, warmup: int) -> Pending[None]:
    """Arm torch.profiler for the rank's next cell (``lab.profile``)."""
    return cast("Pending[None]", _call(target, "start_profile", steps, warmup))


def profile_trace(target: RankTarget) -> Pending[ProfileTrace | None]:
    """-> what the rank's last profiled cell recorded (its Chrome trace, compressed), or None."""
    return cast("Pending[ProfileTrace | None]", _call(target, "profile_trace"))
