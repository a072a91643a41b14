"""One cell's run on the ranks: send, wait, stop what must stop, collect what each rank did.

    run = CellRun(ctx, [0, 1], lambda engine, rank: rpc.run_cell(engine, code, rank, "repr"))
    outcome = run.run(timeout=None, printer=printer)

The run is a small state machine. While ranks run, their output is streamed and the lab's
listeners polled. It ends when every rank answered; or when one rank failed (the others get
``FAILURE_GRACE_S`` to finish, then are stopped: an SPMD program cannot finish without it); or at
the deadline; or on Ctrl-C. Stopping is SIGINT, then releasing ranks stuck in a collective
(``release``), then SIGKILL. The :class:`CellOutcome` says what became of every rank and what was
done; ``recovery`` diagnoses and repairs from it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from ..errors import RankFailure, format_ranks
from .cell_context import CellContext, CellOutcome, RunResult, Send
from .streams import RankPrinter

if TYPE_CHECKING:
    from ..ipycompat import IppAsyncResult

__all__ = ["CellContext", "CellOutcome", "CellRun", "RunResult", "Send"]

# After SIGINT, how long ranks get to leave their cell before distlab aborts the process group
# under them, and then how long before it kills them. Together they stay under 2 s.
INTERRUPT_GRACE_S = 0.8
ABORT_GRACE_S = 0.8
# When one rank fails while others still run, how long the others get to finish on their own.
FAILURE_GRACE_S = 0.3
# In a lab that heals, how many times one rank is replaced in one cell before it is left dead.
MAX_REPLACEMENTS = 3
_POLL_S = 0.02
# A rank's output wakes the cell's loop at once, but it polls at most this often: a rank printing
# line after line (flushed) would otherwise have the notebook poll, listeners and all, per line.
_MIN_POLL_GAP_S = 0.005
# What a rank sends that a poll shows: its lines, its displays, its published data (telemetry, bars).
_NEWS = frozenset({"stream", "display_data", "data_message", "error"})
# How gloo and NCCL word a collective failing because a peer process went away.
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited", re.IGNORECASE
)

class CellRun:
    """One cell sent to some ranks; :meth:`run` waits for it and returns its :class:`CellOutcome`.

    ``send`` sends it to each rank: ``rpc.run_cell``, or ``rpc.run_script`` for a script, whose
    ``filename`` (its path on the ranks) says where its lines are when a rank is stopped.
    """

    def __init__(self, ctx: CellContext, ranks: Sequence[int], send: Send, filename: str | None = None) -> None:
        self.ctx = ctx
        self.outcome = CellOutcome()
        if ctx.heal_end:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ctx.heal_end)  # the last healing cell's end is not this one's
        self._send = send
        self._replacements: dict[int, int] = {}
        self._end_written = False
        self.pending: dict[int, Any] = {}
        self._news = threading.Event()  # set when a rank sent output or ended (``_heard``)
        # rank -> its call's metadata (stdout, stderr, outputs, data), which ipyparallel's thread
        # updates in place; read directly, since AsyncResult's attributes for them wait, and
        # parse the metadata's dates, on every read.
        self._metadata: dict[int, Any] = {}
        for r in ranks:
            self._sent(r, send(ctx.engine(ctx.table[r].engine_id), r))
        self._filename = filename
        self._printer: RankPrinter | None = None
        self._polled_at = 0.0

    def _sent(self, rank: int, ar: IppAsyncResult) -> None:
        self.pending[rank] = ar
        # The AsyncResult's own (the client drops its copy once the output is complete).
        self._metadata[rank] = ar.metadata
        # Woken by the rank's output as it arrives, as %%px streams it, not at the next 20 ms
        # tick: ipyparallel calls a message's ``iopub_callbacks`` after it has updated the
        # metadata. Without them (another ipyparallel), the loop polls every ``_POLL_S``.
        for future in getattr(ar, "_children", None) or ():
            callbacks = getattr(future, "iopub_callbacks", None)
            if isinstance(callbacks, list):
                callbacks.append(self._heard)
        ar.add_done_callback(lambda _: self._news.set())

    def _heard(self, msg: dict[str, Any]) -> None:
        if msg.get("header", {}).get("msg_type") in _NEWS:
            self._news.set()

    def _output(self, rank: int, name: str) -> Any:
        """What rank ``rank`` has sent so far of ``name`` (``stdout``, ``stderr``, ``outputs``, ``data``)."""
        return self._metadata[rank].get(name)

    def run(self, timeout: float | None, printer: RankPrinter | None) -> CellOutcome:
        self._printer = printer
        self.outcome.paused = None
        try:
            self._wait(timeout)
        except KeyboardInterrupt:
            self.outcome.interrupted = True
            self._note_stacks()
            self._stop()
        if self.outcome.paused is not None:
            self._poll()  # what the ranks printed before they stopped; the cell goes on at lab.step()
            return self.outcome
        self._collect()
        return self.outcome

    def stop(self) -> None:
        """Stop the ranks still in the cell (a cell held at a pause whose world ends), and collect."""
        self.outcome.stopped_because = "the lab stopped while the cell was paused"
        with contextlib.suppress(Exception):  # the world is going: what cannot be stopped is killed with it
            self._stop()
            self._collect()

    def result(self) -> RunResult:
        outputs = {rank: list(self._output(rank, "outputs") or []) for rank in self.pending}
        return RunResult(self.outcome.values, self._texts("stdout"), self._texts("stderr"), outputs, self.outcome.notes)

    # ------------------------------------------------------------------------ waiting

    def _wait(self, timeout: float | None) -> None:
        pending, outcome = self.pending, self.outcome
        deadline = None if timeout is None else time.monotonic() + timeout
        first_failure_at: float | None = None
        while True:
            if self.ctx.replace is not None:
                self._replace_the_dead()
                self._tell_late_ranks_where_the_others_ended()
            running = [r for r, ar in pending.items() if not ar.ready()]
            if not running:
                return
            if self.ctx.pauses is not None and not any(_failed(ar) for ar in pending.values() if ar.ready()):
                ended = [r for r in pending if r not in running]
                if (paused := self.ctx.pauses.check(running, ended)) is not None:
                    self.outcome.paused = paused
                    return
            now = time.monotonic()
            if first_failure_at is None and any(self._stops_the_others(ar) for ar in pending.values() if ar.ready()):
                first_failure_at = now
            if first_failure_at is not None and now - first_failure_at > FAILURE_GRACE_S:
                # One rank failed: the others cannot finish an SPMD program without it. Stop them now
                # rather than let them wait out the collective timeout.
                failed = [r for r, ar in pending.items() if ar.ready() and _failed(ar)]
                dead = [r for r in failed if _died(pending[r])]
                # A death is the cause; failures beside it are mostly its neighbours' broken collectives.
                what = f"rank {format_ranks(dead)} died" if dead else f"rank {format_ranks(failed)} failed"
                outcome.stopped, outcome.stopped_because = running, what
                self._stop(abort_first=True)
                return
            if deadline is not None and now > deadline:
                outcome.timed_out = True
                outcome.stopped = running
                outcome.stopped_because = f"the cell ran past its {timeout:g} s deadline"
                self._note_stacks()
                self._stop()
                return
            self._news.wait(_POLL_S)
            self._news.clear()  # before the poll reads: what arrives after it wakes the next wait
            if all(ar.ready() for ar in pending.values()):
                continue  # the cell has ended: its final poll (``_collect``) shows the rest
            gap = self._polled_at + _MIN_POLL_GAP_S - time.monotonic()
            if gap > 0:
                time.sleep(gap)
            self._poll()  # output and telemetry while ranks run

    def _replace_the_dead(self) -> None:
        """A rank that died gets a new process, which runs the cell from its top and heals (``rank.heal``)."""
        replace = self.ctx.replace
        assert replace is not None
        for rank, ar in list(self.pending.items()):
            if not (ar.ready() and _died(ar)) or self._replacements.get(rank, 0) >= MAX_REPLACEMENTS:
                continue
            self._replacements[rank] = self._replacements.get(rank, 0) + 1
            t0 = time.monotonic()
            try:
                target, info = replace(rank)
            except Exception as exc:  # noqa: BLE001 - the cell goes on without it, and says why
                self._replacements[rank] = MAX_REPLACEMENTS
                first = (str(exc).splitlines() or [type(exc).__name__])[0]
                self.outcome.notes.append(f"rank {rank} died and could not be replaced: {first}")
                continue
            self.ctx.table[rank] = info
            if self._printer is not None:  # what the dead rank said last, then its replacement's from the start
                self._printer.feed(rank, "stdout", self._output(rank, "stdout") or "", True)
                self._printer.feed(rank, "stderr", self._output(rank, "stderr") or "", True)
                self._printer.forget(rank)
            self._sent(rank, self._send(target, rank))
            self.outcome.replaced[rank] = time.monotonic() - t0

    def _tell_late_ranks_where_the_others_ended(self) -> None:
        """Once a rank that was not replaced has ended the cell, write the step its quorum reached: a
        replacement, which counts its loop from zero, ends its cell there, and so does a rank that
        healed forward after a stall (``rank.heal``); the others never read it."""
        if self._end_written or not self.ctx.heal_end:
            return
        if all(ar.ready() for ar in self.pending.values()):
            return
        for rank, ar in self.pending.items():
            if rank in self.outcome.replaced or not ar.ready():
                continue
            try:
                reply = ar.get(timeout=0)
            except Exception:  # noqa: BLE001, S112 - a failed rank says nothing of where the loop ended
                continue
            if isinstance(reply, dict) and "step" in reply:
                tmp = f"{self.ctx.heal_end}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(str(int(reply["step"])))
                os.replace(tmp, self.ctx.heal_end)  # read whole or not at all
                self._end_written = True
                return

    def _stops_the_others(self, ar: IppAsyncResult) -> bool:
        """Whether a rank's answer means the others cannot finish: a failure; in a lab that heals, one
        that is not a death (the others' quorum goes on without a rank that died)."""
        return _failed(ar) and not (self.ctx.heals and _died(ar))

    def _wait_ranks(self, ranks: list[int], seconds: float) -> list[int]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._poll()
            ranks = [r for r in ranks if not self.pending[r].ready()]
            if not ranks:
                break
            self.pending[ranks[0]].wait(_POLL_S)
        return [r for r in ranks if not self.pending[r].ready()]

    def _poll(self, final: bool = False) -> None:
        self._polled_at = time.monotonic()
        polled = {rank: _AsPolled(ar, self._output(rank, "data")) for rank, ar in self.pending.items()}
        self.ctx.on_poll(polled, final)
        if self._printer is None:
            return
        for rank in sorted(self.pending):
            self._printer.feed(rank, "stdout", self._output(rank, "stdout") or "", final)
            self._printer.feed(rank, "stderr", self._output(rank, "stderr") or "", final)
            self._printer.show(rank, self._output(rank, "outputs") or [])
        self._printer.flush(final, ended=[r for r, ar in self.pending.items() if ar.ready() and _output_in(ar)])

    # ------------------------------------------------------------------------ stopping

    def _note_stacks(self) -> None:
        """Where the ranks still running are, read before they are stopped: a hang's place."""
        running = [r for r, ar in self.pending.items() if not ar.ready()]
        if self.ctx.stacks is not None and running:
            with contextlib.suppress(Exception):  # the stop goes on whatever the reading does
                self.outcome.notes.append(self.ctx.stacks(running))

    def _stop(self, abort_first: bool = False) -> None:
        """Interrupt ranks still in the cell; free any stuck in a collective; kill what will not stop.

        ``abort_first``: another rank has failed, so the ones still running are (or soon will be)
        waiting for it in a collective; tear the group down at once rather than after SIGINT.
        """
        ctx, outcome = self.ctx, self.outcome
        running = [r for r, ar in self.pending.items() if not ar.ready()]
        if not running:
            return
        if abort_first:
            outcome.group_aborted |= ctx.releaser.abort_on_free_ranks(ctx.client, ctx.table, running)
        with contextlib.suppress(Exception):  # ranks gone meanwhile: the wait below kills what stays
            ctx.client.send_signal(signal.SIGINT, targets=[ctx.table[r].engine_id for r in running], block=True)
        running = self._wait_ranks(running, INTERRUPT_GRACE_S)
        if running:
            # SIGINT cannot reach a rank blocked inside a C++ collective: release it (see release.py).
            if not abort_first:
                ctx.releaser.abort_on_free_ranks(ctx.client, ctx.table, running)
            ctx.releaser.release([ctx.table[r] for r in running])
            outcome.group_aborted = True
            running = self._wait_ranks(running, ABORT_GRACE_S)
        if running:
            outcome.killed = running
            for r in running:
                ctx.kill(r)
            outcome.notes.append(f"rank {format_ranks(running)} did not stop and was killed")

    # ------------------------------------------------------------------------ collecting

    def _collect(self) -> None:
        outcome = self.outcome
        for rank, ar in self.pending.items():
            if not ar.ready():
                if rank in outcome.killed:
                    ar.wait(2.0)  # ipyparallel reports the dead engine promptly
                if not ar.ready():
                    outcome.failures[rank] = RankFailure(rank, "KeyboardInterrupt", "still running when stopped")
                    continue
            try:
                reply = ar.get(timeout=0)
            except ipp.error.EngineError:
                outcome.failures[rank] = RankFailure(rank, "EngineError", "the rank's process died")
                continue
            except ipp.error.RemoteError as exc:
                outcome.failures[rank] = RankFailure(rank, exc.ename, exc.evalue, exc.traceback or "")
                continue
            if "error" in reply:
                err = reply["error"]
                failure = RankFailure(rank, err["ename"], err["evalue"], err["traceback"], err.get("at", 0.0))
                outcome.failures[rank] = failure
            else:
                outcome.values[rank] = reply.get("value", reply.get("repr"))
            if reply.get("lacks"):
                names = ", ".join(reply["lacks"])
                outcome.notes.append(
                    f"rank {rank}'s replacement ended the cell where the others' loop ended, before it could "
                    f"define what the cell's later lines did: it lacks {names}"
                )
        # A rank's reply can overtake its last output (they travel on different channels).
        output_deadline = time.monotonic() + 1.0
        for ar in self.pending.values():
            if ar.ready():
                with contextlib.suppress(Exception):  # late output is shown if it comes; its loss is no failure
                    ar.wait_for_output(timeout=max(0.0, output_deadline - time.monotonic()))
        dead = [r for r, f in outcome.failures.items() if f.ename == "EngineError"]
        for rank, failure in list(outcome.failures.items()):
            if dead and rank not in dead and _PEER_GONE.search(failure.evalue):
                # gloo noticed the dead peer before distlab did: say so in the same words.
                outcome.failures[rank] = RankFailure(
                    rank, "Stopped", f"rank {format_ranks(dead)} died while this rank was in a collective with it"
                    f"{_cell_line(failure.traceback, self._filename)}", failure.traceback,
                )
        # A rank that finished with a value while it was being stopped (in the grace after SIGINT)
        # was not stopped: it is reported with its value alone.
        outcome.stopped = [r for r in outcome.stopped if r not in outcome.values]
        for rank in outcome.stopped:
            # Say why distlab stopped the rank; what it was doing stays in the message.
            was = outcome.failures.get(rank)
            doing = _cell_line(was.traceback, self._filename) if was is not None else ""
            outcome.failures[rank] = RankFailure(
                rank, "Stopped", f"stopped by distlab: {outcome.stopped_because}{doing}", was.traceback if was else ""
            )
        self._poll(final=True)

    def _texts(self, name: str) -> dict[int, str]:
        return {rank: self._output(rank, name) or "" for rank in self.pending}


def _output_in(ar: IppAsyncResult) -> bool:
    """Whether a finished rank's last output came too (its reply can overtake it): a fold of alike
    lines must not give up on a rank whose line is on its way. Never waits."""
    with contextlib.suppress(Exception):  # any failure to ask: treated as arrived, never waits
        return bool(ar.wait_for_output(timeout=0))
    return True


class _AsPolled:
    """A rank's ``AsyncResult`` as one poll saw it: what the rank published (``data``) read once.
    ipyparallel's thread updates ``data`` whenever a rank publishes; read twice in one poll, the lab's
    telemetry store and a listener after it could see two publishes. The rest is the AsyncResult's."""

    __slots__ = ("_ar", "data")

    def __init__(self, ar: IppAsyncResult, data: dict[str, Any] | None) -> None:
        self._ar = ar
        self.data = dict(data or {})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ar, name)


def _cell_line(traceback_text: str, filename: str | None = None) -> str:
    """'; it was at line 4: dist.all_reduce(t)', from the deepest frame of the user's cell (or script)."""
    lines = traceback_text.splitlines()
    name = re.escape(filename) if filename else r"<rank \d+ cell>"
    for i in range(len(lines) - 1, -1, -1):
        if match := re.search(rf'File "{name}", line (\d+)', lines[i]):
            source = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"; it was at line {match.group(1)}: {source}"
    return ""


def _failed(ar: IppAsyncResult) -> bool:
    try:
        reply = ar.get(timeout=0)
    except Exception:  # noqa: BLE001 - a remote or engine error is a failure
        return True
    return isinstance(reply, dict) and "error" in reply


def _died(ar: IppAsyncResult) -> bool:
    try:
        ar.get(timeout=0)
    except ipp.error.EngineError:
        return True
    except Exception as exc:  # noqa: BLE001 - the hub's report of a death arrives as a RemoteError
        return getattr(exc, "ename", "") == "EngineError"
    return False
