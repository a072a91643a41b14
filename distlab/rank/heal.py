"""Healing on a rank: ``model, opt = distlab.heal(model, opt)``, then an ordinary training loop.

Each rank is a replica group of its own on torchft: every step, ``opt.zero_grad()`` asks the lab's
lighthouse (``cluster.lighthouse``) for a quorum of the ranks alive now; ``loss.backward()``
averages gradients over that quorum only; ``opt.step()`` commits the step only if every member's
exchange succeeded. When a rank dies, the others' step in flight does not commit, and their next
step forms without it one heartbeat timeout later. A rank that joins behind the others (a
replacement) is sent the model and optimizer state by a live peer before its first step, over the
quorum's own gloo group (torchft's ``PGTransport``: no HTTP server on the host's name).

A replacement for a rank that died runs the cell from its first line in a new process (it has
none of the names earlier cells made: a healing cell builds its model, optimizer and data
itself, as a torchrun script does). Its first quorum heals it to the others' step; it then steps
with them. Its loop, counted from zero, would run past theirs: when the others' cell has ended,
the lab writes the step they ended at (``DISTLAB_HEAL_END``, a file), and the replacement's loop
ends at its next step (``WorldFinished``); the cell's statements after the one that loop is in then
run on the replacement too (``rank.cell``), so that it holds what the others' cell defined after its
loop. A replacement that came too late to heal from a live peer (the others ended first) runs none
of them: it is given their state when the cell has ended (``share_state``), the lab says which
happened, and the names it lacks. A quorum lasts
for the cell it was made in: at the cell's end every rank's manager ends.

Each step's quorum and each heal are recorded as they happen and sent to the notebook
(``rank.quorums``): the quorum's ranks from torchft's gloo group, which its manager configures for
each new quorum; a heal's source, bytes and seconds from its transfer (``PGTransport``).

What torchft cannot narrow: each rank's manager server and its store listen on every interface of
the host (or of the rank's node, in a lab on emulated nodes); the lighthouse listens on the lab's
address only. ``../shared/FACTS.md`` has what was measured.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist

from ..errors import LabUsageError
from ..wire import HEALING_QUORUM_TIMEOUT_S, HEALING_RANK_ENVIRONMENT, LIGHTHOUSE_PID_FILE
from . import quorums, torchcompat_torchft
from .hooks import at_cell_end
from .identity import address_toward

if TYPE_CHECKING:
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

__all__ = [
    "Healing", "WorldFinished", "current", "ended_step", "heal", "is_replacement", "lighthouse_pid", "set_lighthouse",
    "share_state", "shutdown",
]

_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: its Manager reads it too
_END_FILE = "DISTLAB_HEAL_END"  # where the lab writes the step the others' cell ended at
# Quorum, collective and transfer deadlines: a death is noticed by the lighthouse's heartbeat
# timeout (1 s); these only bound what hangs on a peer that is gone.
_TIMEOUT = timedelta(seconds=10)
_QUORUM_TIMEOUT = timedelta(seconds=HEALING_QUORUM_TIMEOUT_S)
_HEARTBEAT = timedelta(milliseconds=100)


class WorldFinished(BaseException):
    """Raised in a replacement's loop once it reached the step where the others' cell ended."""


def caught_up() -> bool:
    """Whether this replacement's quorum reached the step the others' cell ended at (it healed and
    stepped with them): what follows its loop in the cell then runs on the others' state."""
    end = _world_ended_at()
    return end is not None and _current is not None and _current.manager.current_step() == end


def became_replacement(replacing: bool = True) -> None:
    """This process is a rank that died, started again while the others' cell runs
    (``rank.group.join_as_replacement``); False once it joined the whole group (``init_rank``)."""
    global _replacement
    _replacement = replacing


def is_replacement() -> bool:
    """Whether this process took the place of a rank that died while the running cell ran."""
    return _replacement


def set_lighthouse(address: str, end_file: str = "") -> None:
    """Where this rank's lab runs its lighthouse, and the file it writes a healing cell's end in
    ("" where the lab does not heal)."""
    for name, value in ((_LIGHTHOUSE, address), (_END_FILE, end_file)):
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    if address:
        for name, value in HEALING_RANK_ENVIRONMENT.items():
            os.environ.setdefault(name, value)


_replacement = False  # this process took the place of a rank that died (``join``)


def _world_ended_at() -> int | None:
    """The step the others' cell ended at, once the lab wrote it, where this rank's loop counts behind
    its quorum's steps: a replacement, or a rank that healed forward (it stalled, was dropped from the
    quorum, and healed to the others' step when it came back)."""
    if not (_replacement or (_current is not None and _current.healed_forward)):
        return None
    path = os.environ.get(_END_FILE, "")
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class Healing:
    """One rank's torchft manager and what it wraps; ``manager.current_step()`` is the healed step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, lighthouse: str) -> None:
        from torchft.manager import Manager

        # torchft says, at every quorum, that it cannot reset NCCL's flight recorder (there is no NCCL
        # here) and, when it heals, that torch deprecated what it calls and that a buffer it reads
        # is read-only: its errors still show.
        logging.getLogger("torchft").setLevel(logging.ERROR)
        for category in (FutureWarning, UserWarning):
            warnings.filterwarnings("ignore", category=category, module=r"torchft\.")
        host = address_toward(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        # The replica group's store (one rank per group here): its manager finds its peers' through it.
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT)
        # What the notebook shows of the cell's quorums and heals (``rank.quorums``).
        self.log = quorums.begin(rank, _replacement)
        self.pg = _recording_pg_class()(timeout=_TIMEOUT)
        self.model, self.optimizer = model, optimizer
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=1,
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=self.store.port,
            lighthouse_addr=lighthouse,
            replica_id=f"distlab_rank{rank}",
            hostname=host,
            timeout=_TIMEOUT,
            quorum_timeout=_QUORUM_TIMEOUT,
            connect_timeout=_TIMEOUT,
            heartbeat_interval=_HEARTBEAT,
            checkpoint_transport=_recording_transport_class()(self.pg, timeout=_TIMEOUT, device=torch.device("cpu")),
        )
        self.lost_quorums = quorums.LostQuorums()  # those that failed, in a row (``_lost_quorum``)
        self.healed_forward = False  # healed past steps it had not taken (``RecordingTransport``)
        self.ddp: torch.nn.Module = torchcompat_torchft.healing_ddp_class(_lost_quorum)(self.manager, model)
        self.opt = _healing_optimizer_class()(self.manager, optimizer)

    def _state(self) -> _HealState:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def _load(self, state: _HealState) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        self.pg.shutdown()


class _HealState(TypedDict):
    """What a live peer sends a healing rank: the model's and the optimizer's state dicts."""

    model: dict[str, object]
    optim: dict[str, object]


@functools.cache
def _healing_optimizer_class() -> type[OptimizerWrapper]:
    from torchft.optim import OptimizerWrapper

    class HealingOptimizer(OptimizerWrapper):
        """torchft's optimizer wrapper; a replacement's ends its cell where the others' loop ended."""

        def _stop_where_the_world_did(self) -> None:
            # Whatever this rank's step: in a quorum it is the others' (their last), and alone it must
            # not train on (the lab gives it the others' state when the cell has ended).
            end = _world_ended_at()
            if end is not None:
                raise WorldFinished(f"the other ranks' cell ended at step {end}")

        def zero_grad(self, set_to_none: bool = True) -> None:
            self._stop_where_the_world_did()
            super().zero_grad(set_to_none)

        def step(self, closure: object = None) -> None:
            self._stop_where_the_world_did()  # before the vote: a quorum of one must not commit past the others
            manager = self.manager
            # Read before the vote: the step's quorum (waited for, as backward's exchange did), and
            # whether this rank heals in it (a healing rank's gradients do not count).
            try:
                seen = manager.num_participants(), manager.is_participating()
            except Exception:  # noqa: BLE001 - a failed quorum: torchft raises it where it always did
                seen = None
            before = manager.current_step()  # a healing rank's is the others', once healed
            super().step(closure)
            if _current is not None:
                _current.lost_quorums.stepped(manager.current_step() > before)
            log = quorums.current()
            if log is not None and seen is not None:
                log.attempt(before + 1, seen[0], seen[1], manager.current_step() > before)
                quorums.changed()

    return HealingOptimizer


@functools.cache
def _recording_pg_class() -> type[ProcessGroupGloo]:
    from torchft.process_group import ProcessGroupGloo

    class RecordingGloo(ProcessGroupGloo):
        """torchft's gloo group, which its manager configures anew for each new quorum: the quorum's
        id and ranks are recorded first (torchft's manager keeps its replica ids to itself)."""

        def configure(
            self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
            group_rank: int | None = None, group_world_size: int | None = None, global_ranks: list[int] | None = None,
        ) -> None:
            log = quorums.current()
            if log is not None:
                # global_ranks: the quorum's ranks in replica order (a replica group here is one
                # rank, ``distlab_rank<N>``: torchft reads N from the replica id).
                log.quorum(-1 if quorum_id is None else quorum_id, list(global_ranks or []))
            super().configure(
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )

    return RecordingGloo


@functools.cache
def _recording_transport_class() -> type[PGTransport]:
    from torchft.checkpointing.pg_transport import PGTransport

    class RecordingTransport(PGTransport):
        """torchft's transfer of a live peer's state over the quorum's group, timed and counted."""

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> object:
            t0 = time.perf_counter()
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            seconds = time.perf_counter() - t0
            healing = _current
            if healing is not None and step > 0:
                # To the others' step past the first: steps its loop did not count (a stall dropped it
                # from their quorum), so its loop would run on past theirs (``_world_ended_at``).
                healing.healed_forward = True
            log = quorums.current()
            if log is not None:
                # torchft heals it to the others' ``step``: the next is the first it takes with them.
                log.healed(step + 1, log.member(src_rank), _tensor_bytes(state), seconds)
                quorums.changed()
            return state

    return RecordingTransport


def _lost_quorum(exc: BaseException) -> None:
    """The running step's quorum failed (``torchcompat_torchft``'s gradient hook): said and counted."""
    if _current is not None:
        _current.lost_quorums.lost(_current.manager.current_step() + 1, exc)


def lighthouse_pid() -> int | None:
    """The pid of the lab's running lighthouse (``wire.LIGHTHOUSE_PID_FILE``, in the lab's folder)."""
    end = os.environ.get(_END_FILE, "")
    try:
        with open(os.path.join(os.path.dirname(end), LIGHTHOUSE_PID_FILE)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _tensor_bytes(state: object) -> int:
    """The bytes of the tensors in a nested state dict."""
    if isinstance(state, torch.Tensor):
        return state.nelement() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


_current: Healing | None = None
_last: Healing | None = None  # the one the last healing cell made, once it ended


def heal(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.nn.Module, OptimizerWrapper]:
    """``model, opt = distlab.heal(model, opt)`` on every rank of a lab started with ``heal=True``.

    Returns the model wrapped for a per-step quorum (gradients averaged over the ranks alive) and
    the optimizer wrapped to commit a step only when the quorum's exchange succeeded. Call it again
    (a cell run again) and the previous one ends first.
    """
    global _current, _last
    _last = None
    lighthouse = os.environ.get(_LIGHTHOUSE, "")
    if not lighthouse:
        raise LabUsageError(
            "distlab.heal needs a lab that heals: start it with %dist start -n 4 --heal "
            "(distlab.start(ranks=4, heal=True))"
        )
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise LabUsageError("distlab.heal wraps the model itself: pass the model, not DDP(model)")
    if not isinstance(model, torch.nn.Module):
        raise LabUsageError(f"distlab.heal(model, opt): model must be a torch.nn.Module (got {type(model).__name__})")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise LabUsageError(
            f"distlab.heal(model, opt): opt must be a torch.optim.Optimizer (got {type(optimizer).__name__})"
        )
    shutdown()
    _current = Healing(model, optimizer, int(os.environ.get("RANK", "0")), lighthouse)
    if not _replacement and dist.is_initialized():
        # The lighthouse forms a quorum of the replicas it hears from: a rank whose manager started
        # late would miss the first steps and heal into them. Every manager exists after the
        # barrier; two heartbeats later the lighthouse has heard from each.
        dist.barrier()
        time.sleep(2 * _HEARTBEAT.total_seconds())
    return _current.ddp, _current.opt


def current() -> Healing | None:
    """This rank's healing, once ``heal`` made one."""
    return _current


def share_state(src: int) -> bool | None:
    """After a healing cell with a replacement, on every rank, over the whole group formed again:
    True if every rank's model and optimizer were already bit-identical (the replacement healed
    from a live peer); else rank ``src``'s are copied to every rank, and False. None (on every
    rank alike) where a rank made no healing in the cell: nothing to compare."""
    last = _last
    digest = _digest(last.model, last.optimizer) if last is not None else None
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if None in digests:
        return None
    if len(set(digests)) == 1:
        return True
    assert last is not None
    state = [last._state() if dist.get_rank() == src else None]
    dist.broadcast_object_list(state, src=src)
    assert state[0] is not None
    last._load(state[0])
    return False


def _digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for state in optimizer.state_dict()["state"].values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def ended_step() -> int | None:
    """The step this rank's quorum reached, where a healing cell made one (what its reply carries)."""
    return _current.manager.current_step() if _current is not None else None


@at_cell_end
def shutdown() -> None:
    """End this rank's manager (its heartbeats stop: the quorum goes on without it): at each cell's end."""
    global _current, _last
    healing, _current = _current, None
    if healing is not None:
        healing.shutdown()
        _last = healing  # its model and optimizer, for share_state
