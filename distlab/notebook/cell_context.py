"""What a cell's run is given and what it gives back: the lab's parts it needs (:class:`CellContext`),
what became of each rank (:class:`CellOutcome`, for ``recovery``) and the values and output it
returns (:class:`RunResult`). ``cell.CellRun`` is the run itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import RankFailure
from . import rpc
from .observers import Listener
from .pause import Pause, PauseControl
from .release import Releaser
from .world import RankInfo

if TYPE_CHECKING:
    from ..ipycompat import IppClient

__all__ = ["CellContext", "CellOutcome", "RunResult", "Send"]

#: Sends the work to one rank: ``(engine, rank) -> AsyncResult`` of a ``wire.CellReply`` (an ``rpc`` call).
Send = Callable[[Any, int], Any]


class RunResult(dict[int, Any]):
    """{rank: value of the cell's last expression (None for a statement)}, plus each rank's output:
    ``stdout`` and ``stderr`` text, and ``outputs``, what it displayed (Jupyter's display_data
    contents: ``{"data": {mime: ...}, "metadata": ...}``), and ``notes``: what distlab did while it
    ran (in a lab that heals, a rank it replaced). ``paused``: the cell is not over, its ranks wait
    before a collective (a breakpoint, ``lab.pause``); it holds no values then."""

    def __init__(
        self,
        values: dict[int, Any],
        stdout: dict[int, str],
        stderr: dict[int, str],
        outputs: dict[int, list[dict[str, Any]]] | None = None,
        notes: list[str] | None = None,
        paused: Pause | None = None,
    ):
        super().__init__(sorted(values.items()))
        self.stdout = stdout
        self.stderr = stderr
        self.outputs = outputs or {}
        self.notes = notes or []
        self.paused = paused


@dataclass
class CellOutcome:
    """What became of one cell on each rank, and what distlab did about it."""

    values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)  # ranks distlab stopped, and why
    stopped_because: str = ""
    interrupted: bool = False
    timed_out: bool = False
    group_aborted: bool = False
    #: Ranks that died and were replaced while the cell ran: rank -> seconds until the replacement ran the cell.
    replaced: dict[int, float] = field(default_factory=dict)
    #: Set when every rank still running waits before a collective (a breakpoint): the cell is not over.
    paused: Pause | None = None


@dataclass(frozen=True)
class CellContext:
    """What a cell's run needs of its lab."""

    client: IppClient
    table: list[RankInfo]  # the lab's rows when the cell started; a replacement's row is put in
    releaser: Releaser
    kill: Callable[[int], None]
    #: The lab's poll: its telemetry store, then its listeners (``observers.ObserverBus.poll``).
    on_poll: Listener
    #: The lab heals (``heal=True``): a rank's death does not stop the others, whose quorum goes on without it.
    heals: bool = False
    #: Where the lab heals: a new engine in a dead rank's place, its view and row (``healing.Healer.replace_rank``).
    replace: Callable[[int], tuple[Any, RankInfo]] | None = None
    #: Where the lab heals: the file a replacement reads the step the others' cell ended at from (``rank.heal``).
    heal_end: str = ""
    #: engine id -> the engine to send calls to, made once per client and kept (``engine``).
    engines: dict[int, rpc.Engine] = field(default_factory=dict)
    #: The live stacks of the given ranks, as a note (``stacks.StacksReader.of_stopped``): read before a
    #: cell's ranks are stopped at its deadline or by Ctrl-C, to show where they were.
    stacks: Callable[[list[int]], str] | None = None
    #: The cell was armed with a breakpoint (``lab.pause``): its ranks are asked whether they are paused.
    pauses: PauseControl | None = None

    def engine(self, engine_id: int) -> rpc.Engine:
        """One engine, to send it calls (``rpc.Engine``). Made once and kept: ``client[id]`` builds
        a new DirectView each time (traitlets and all), a millisecond of an empty cell's 20 at 2 ranks."""
        engine = self.engines.get(engine_id)
        if engine is None:
            engine = self.engines[engine_id] = rpc.Engine(self.client, engine_id)
        return engine
