"""The data the notebook and the ranks exchange: what a rank says of itself, and how it joins a group.

Both sides import this module and nothing else of each other's (it imports neither torch nor
ipyparallel). ``distlab.notebook.rpc`` sends these; ``distlab.rank`` receives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

__all__ = [
    "CELL_FILE",
    "HEALING_KEY",
    "HEALING_MODULES",
    "HEALING_QUORUM_TIMEOUT_S",
    "HEALING_RANK_ENVIRONMENT",
    "LEARNER_FILE",
    "LIGHTHOUSE_PID_FILE",
    "PAUSE_REPLY",
    "PAUSE_REQUEST",
    "PROGRESS_KEY",
    "RELEASE_REPLY",
    "RELEASE_REQUEST",
    "Breakpoint",
    "CellError",
    "CellReply",
    "CollectiveEntry",
    "EngineIdentity",
    "GroupSpec",
    "HealEvent",
    "HealingPublish",
    "PausedAt",
    "PointToPointEntry",
    "ProfileTrace",
    "ProgressBar",
    "ProgressPublish",
    "QuorumSpan",
    "RankJoined",
    "TensorSeen",
]

#: The file name a learner's code carries on an exercise's grading ranks (``rank.exercise``): the
#: notebook finds the learner's frames in a traceback by it.
LEARNER_FILE = "<your code>"

#: The file name a rank's cell runs under (``rank.cell``, ``.format(rank=N)``): the notebook takes the
#: rank out of it to group identical tracebacks across ranks (``errors``).
CELL_FILE = "<rank {rank} cell>"

#: The control message that asks a stuck rank to cut its connections to its peers
#: (``notebook.release`` sends it, ``rank.release`` serves it), and the rank's answer. Both travel on
#: ipyparallel's control channel, which an engine serves while its main thread waits in C++.
RELEASE_REQUEST = "distlab_release_request"
#: A paused world's control messages (``rank.pause``): what a rank is paused at, step, continue, read.
PAUSE_REQUEST = "distlab_pause_request"
PAUSE_REPLY = "distlab_pause_reply"
RELEASE_REPLY = "distlab_release_reply"


class EngineIdentity(TypedDict):
    """What an engine says of itself before it has a rank (``rank.identity.describe``)."""

    host: str
    pid: int
    #: The address other hosts reach this engine at (its route toward the controller).
    addr: str
    #: The machine's boot id: equal for engines on one machine, whatever namespace they run in.
    machine: str
    cuda_devices: int
    #: The rank MPI or Slurm gave the process, when a launcher did.
    launcher_rank: int | None
    python: str
    torch: str


@dataclass(frozen=True)
class GroupSpec:
    """Everything one rank needs to join the world's process group (``rank.group.init_rank``)."""

    rank: int
    world_size: int
    local_rank: int
    #: Ranks on this rank's machine (all its emulated nodes together): CPU threads are shared among them.
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str
    timeout_s: float
    #: torch's collective checking (TORCH_DISTRIBUTED_DEBUG=DETAIL).
    debug: bool = False
    #: The index of this rank's host (node) among the world's hosts, in rank order: torchrun's GROUP_RANK.
    node: int = 0
    #: The world's hosts: torchrun's GROUP_WORLD_SIZE.
    nodes: int = 1
    #: Ranks on this rank's host: torchrun's LOCAL_WORLD_SIZE (0: ``local_world_size``).
    ranks_on_node: int = 0
    #: The device the rank binds ("cuda:1", "cpu"); "" for the backend's own (NCCL: ``cuda:<local_rank>``).
    device: str = ""
    #: A healing lab's torchft lighthouse ("http://host:port"); "" where the lab does not heal.
    lighthouse: str = ""
    #: Where a healing lab writes the step the others' cell ended at, for a replacement (``rank.heal``).
    heal_end: str = ""


class RankJoined(TypedDict):
    """A rank's answer to ``init_rank`` / ``rebuild_group``: its device and how long joining took."""

    device: str
    init_s: float


class CollectiveEntry(TypedDict):
    """One collective of a rank's flight recorder (``rank.flight.collective_trace``)."""

    #: The group's count of collectives (or, for send and recv, of point-to-point operations), from 1.
    seq: int
    op: str
    shapes: list[list[int]]
    dtypes: list[str]
    p2p: bool
    #: The process group's name (its id, "0" for the default group), its description (a mesh
    #: dimension's is "mesh_<dim>"), and its members' global ranks.
    group: str
    desc: str
    members: list[int]


class PointToPointEntry(CollectiveEntry, total=False):
    """A send or a receive (``p2p`` true): the latest one per group, op and peer, ``seq`` counting them."""

    #: The peer's global rank (-1: a receive from any source), and whether one is still pending.
    peer: int
    pending: bool


class CellError(TypedDict):
    ename: str
    evalue: str
    traceback: str
    at: float  # when the rank raised it (time.time()): the report leads with the first


#: What a healing rank imports (``distlab.heal``): the warm template preloads them where a lab heals,
#: so that a replacement rank starts with them (about 3 s of imports otherwise).
HEALING_MODULES = [
    "torchft.manager", "torchft.ddp", "torchft.optim", "torchft.process_group", "torchft.checkpointing.pg_transport"
]
#: torchft's compiled part logs every quorum at INFO to stderr (a cell's output): warnings only,
#: unless the user chose (RUST_LOG is read when it first logs).
HEALING_RANK_ENVIRONMENT = {"RUST_LOG": "warn"}
#: In a healing lab's folder (beside its end file): the pid of its running lighthouse, which
#: ``distlab.chaos(lighthouse=step)`` kills on rank 0 (the lab writes it again when it restarts one).
LIGHTHOUSE_PID_FILE = "lighthouse.pid"
#: How long a healing rank's manager waits for a quorum (torchft's ``quorum_timeout``): a quorum lost
#: with a lighthouse that died fails after this long.
HEALING_QUORUM_TIMEOUT_S = 30.0


class CellReply(TypedDict, total=False):
    """A rank's answer to a cell: exactly one of ``value``, ``repr`` or ``error``."""

    value: Any
    repr: str | None
    error: CellError
    #: In a lab that heals, the step the cell's quorum reached (``rank.heal``), where it made one.
    step: int
    #: In a replacement whose cell ended where the others' loop did: what the cell binds at its top
    #: level that this rank lacks (the statements it did not run to their end).
    lacks: list[str]


class ProfileTrace(TypedDict):
    """What a rank recorded under ``lab.profile`` (``rank.profiling.profile_trace``)."""

    #: torch.profiler's Chrome-trace JSON, as it exported it, zlib-compressed (a tenth of the bytes).
    trace: bytes
    #: Optimizer steps recorded whole; 0 when the cell was profiled whole (``whole``) or ended first.
    steps: int
    #: True when the cell made no optimizer step: the recording is the whole cell.
    whole: bool
    #: Optimizer steps the cell made in all.
    optimizer_steps: int
    #: The native id of the thread that ran the cell: its ops are the rank's compute on a CPU.
    tid: int


#: The key of a rank's tqdm bars in its ``publish_data`` (``rank.progress`` sends, ``dashboard.progress`` draws).
PROGRESS_KEY = "distlab.progress"


class ProgressBar(TypedDict):
    """One tqdm bar's state, as its rank last saw it."""

    #: Unique on its rank (bars are numbered as they are made).
    id: int
    n: int | float
    total: int | float | None
    desc: str
    unit: str
    #: tqdm's ``unit_scale``: False, True (SI prefixes) or a factor.
    unit_scale: bool | float
    postfix: str
    elapsed: float
    #: Units per second (tqdm's smoothed rate; the average once the bar closed), None before any.
    rate: float | None
    closed: bool


class ProgressPublish(TypedDict):
    """All the bars one rank shows in the running cell, in the order they were made: each publish
    carries them all, since ipyparallel keeps only a key's latest value."""

    rank: int
    seq: int
    bars: list[ProgressBar]


#: The key of a healing rank's record of its quorums and heals in its ``publish_data``
#: (``rank.quorums`` sends, ``notebook.healing_record`` folds, ``dashboard.healing`` draws).
HEALING_KEY = "distlab.healing"


class QuorumSpan(TypedDict):
    """Consecutive step attempts of one rank that agree in all but their step (steps ``first`` to
    ``last``; an attempt that did not commit is retried at the same step)."""

    first: int
    last: int
    #: Attempts in the span: ``last - first + 1`` for committed steps, the retries for one that failed.
    attempts: int
    #: torchft's quorum id (a new one each time the quorum's members change).
    quorum: int
    #: The ranks in the quorum, in torchft's replica order (its ``recover_src_replica_rank`` indexes it).
    members: list[int]
    #: torchft's ``num_participants()``: the members whose gradients the step averaged.
    participants: int
    #: Whether this rank was one of them (not while it healed: it was sent the others' state instead).
    participating: bool
    committed: bool


class HealEvent(TypedDict):
    """A rank was sent a live peer's model and optimizer state by torchft's ``PGTransport``."""

    #: The step whose quorum healed it: the first it took with the others.
    step: int
    #: The rank that sent the state.
    source: int
    #: The state's tensors, in bytes.
    bytes: int
    #: How long receiving took.
    seconds: float


class HealingPublish(TypedDict):
    """All one rank's process recorded in the running healing cell: each publish carries it all,
    since ipyparallel keeps only a key's latest value. A rank that died and was replaced publishes
    again from its new process (another ``pid``)."""

    rank: int
    pid: int
    seq: int
    #: This process took the place of a rank that died in the cell.
    replacement: bool
    #: Oldest first; at most ``rank.quorums.MAX_SPANS``, the oldest left out past that (``dropped``).
    spans: list[QuorumSpan]
    dropped: int
    heals: list[HealEvent]


@dataclass(frozen=True)
class Breakpoint:
    """Stop before the ``at``-th collective of the next cell that matches ``op``, ``group`` and
    ``line`` (each None: any); wait ``deadline_s`` at most for the notebook's word."""

    at: int = 1
    op: str | None = None
    group: str | None = None
    line: int | None = None
    deadline_s: float = 600.0

    def says(self) -> str:
        """'the 3rd all_gather on mesh_tp at line 12', as a learner would say it."""
        what = self.op or "collective"
        where = (f" on {self.group}" if self.group else "") + (f" at line {self.line}" if self.line else "")
        return f"the {_ordinal(self.at)} {what}{where}"


class TensorSeen(TypedDict):
    shape: list[int]
    dtype: str
    norm: float
    hash: str


class PausedAt(TypedDict):
    """What a rank waits before, as the notebook reads it (JSON)."""

    seq: int  # which pause of this rank: a step makes the next
    index: int  # the collective's place among the cell's collectives, from 1
    op: str
    group: str
    group_ranks: list[int]
    line: int | None  # the cell's line that launched it
    source: str
    tensors: list[TensorSeen]


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
