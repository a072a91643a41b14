"""A rank's one publisher: what it sends the notebook while a cell runs, rate-limited, off the training thread.

Three things on a rank publish through ipyparallel's ``publish_data``: a watch's steps
(``records.PUBLISH_KEY``, ``telemetry/watch.py``), tqdm's bars (``wire.PROGRESS_KEY``,
``rank/progress.py``) and a healing cell's quorums and heals (``wire.HEALING_KEY``,
``rank/quorums.py``). Each is a :class:`Source` of one :class:`Publisher`: the training thread only
marks new data (:meth:`Source.notify`), and one daemon thread sends what is due in one
``publish_data`` (a dict with a key per source), at most one per ``interval_s`` for the rank and one per
a source's own interval for that source. ipyparallel keeps the latest value of each key on the client
(``AsyncResult.data``, updated key by key), so one publish carrying several keys is a publish of each to it.

The cell's end sends a source's last state from the caller's thread (:meth:`Source.flush`), before
the reply. A send is bounded: a flush that meets a send that never returns gives up after
``_SEND_WAIT_S``, and a source that keeps its final state (a watch's whole buffer) is owed it: the
thread sends it once the send in the way returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["PUBLISH_INTERVAL_S", "Publisher", "Sender", "Source", "engine_sender", "rank_publisher"]

#: Seconds between two publishes of one rank, at least: ten a second at most, whatever publishes.
PUBLISH_INTERVAL_S = 0.1

#: ipyparallel's ``publish_data``: {key: payload}.
Sender = Callable[[dict[str, object]], None]
#: What a source sends: ``build(final)`` (final: the cell is ending, or the source closing), or None for nothing.
Build = Callable[[bool], object]

#: How long a publish waits for another one in progress (the thread's, or a flush) before giving up.
_SEND_WAIT_S = 2.0


def engine_sender() -> Sender | None:
    """ipyparallel's ``publish_data`` when this process is an ipyparallel engine, else None."""
    from .. import ipycompat_engine

    if not ipycompat_engine.on_engine():
        return None
    from ipyparallel.datapub import publish_data

    publish: Sender = publish_data
    return publish


class Source:
    """One thing a rank publishes, under ``key``: made by :meth:`Publisher.source`."""

    def __init__(self, publisher: Publisher, key: str, build: Build, interval_s: float, keep_final: bool) -> None:
        self.key = key
        self.interval_s = interval_s
        self.sent = 0  # publishes that carried this source
        self._publisher = publisher
        self._build = build
        self._keep_final = keep_final
        self._dirty = False
        self._owed_final = False  # a final publish that could not go out yet: the thread sends it
        self._last_sent = float("-inf")
        self._closed = False

    @property
    def error(self) -> str | None:
        """Why publishing stopped (a send raised), or None."""
        return self._publisher.error

    def notify(self) -> None:
        """New data: send it within this source's interval (and the rank's)."""
        self._publisher._mark(self)

    def flush(self) -> bool:
        """Send this source's final state now, from the caller's thread; True if it went out (or had nothing)."""
        return self._publisher._flush(self)

    def close(self) -> None:
        """Send the final state once more, then nothing from this source again."""
        self._publisher._flush(self)
        self._closed = True
        self._publisher._remove(self)


class Publisher:
    """Sends what its sources have, through ``send``, at most once per ``interval_s``, from a daemon thread.

    Its sends go out on the engine's IOPub thread (thread-safe), under the request the engine is
    serving, so they reach the cell's AsyncResult while the cell runs. A send that raises stops every
    publish (``error`` says why): what a rank shows must never break its training.
    """

    def __init__(self, send: Sender, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        self._send = send
        self.interval_s = interval_s
        self.error: str | None = None
        self._sources: list[Source] = []
        self._wake = threading.Condition()  # guards _sources and the sources' flags; wakes the thread
        self._sending = threading.Lock()  # one build-and-send at a time: the thread's, or a flush
        self._last_sent = float("-inf")
        self._stop = False
        self._thread: threading.Thread | None = None

    def source(self, key: str, build: Build, interval_s: float | None = None, *, keep_final: bool = False) -> Source:
        """A new source publishing ``build(final)`` under ``key``, at most once per ``interval_s`` (the
        publisher's own by default). ``keep_final``: a final state a flush could not send is owed, and sent later."""
        src = Source(self, key, build, max(interval_s or 0.0, self.interval_s), keep_final)
        with self._wake:
            self._sources.append(src)
        return src

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (what is owed is left unsent)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the sources' calls

    def _mark(self, src: Source) -> None:
        with self._wake:
            if src._closed:
                return
            src._dirty = True
            if self._thread is None:  # started by the first data: a rank that never publishes has no thread
                self._thread = threading.Thread(target=self._loop, name="distlab-publish", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _remove(self, src: Source) -> None:
        with self._wake:
            if src in self._sources:
                self._sources.remove(src)

    def _flush(self, src: Source) -> bool:
        # Bounded wait: a send that never returns must not hold a cell's end (flush) or close forever.
        if not self._sending.acquire(timeout=_SEND_WAIT_S):
            if src._keep_final:
                src._owed_final = True  # the whole buffer, once the send in the way returns
                self._mark(src)
            return False
        try:
            with self._wake:
                src._dirty = False
            self._publish([(src, True)])
            return True
        finally:
            self._sending.release()

    # ------------------------------------------------------------------ the thread

    def _due(self, now: float) -> tuple[list[Source], float | None]:
        """The dirty sources whose interval has passed, and when the next one will be (None: none dirty)."""
        rank_ready = self._last_sent + self.interval_s
        due, soonest = [], None
        for src in self._sources:
            if not src._dirty:
                continue
            ready = max(rank_ready, src._last_sent + src.interval_s)
            if ready <= now:
                due.append(src)
            soonest = ready if soonest is None else min(soonest, ready)
        return due, soonest

    def _loop(self) -> None:
        while True:
            with self._wake:
                while True:
                    if self._stop:
                        return
                    due, soonest = self._due(time.monotonic())
                    if due:
                        break
                    self._wake.wait(None if soonest is None else max(0.0, soonest - time.monotonic()))
            with self._sending:
                with self._wake:
                    # A flush may have sent one meanwhile; each key once per publish (a second source
                    # under the same key goes in the next).
                    batch: dict[str, tuple[Source, bool]] = {}
                    for src in due:
                        if src._dirty and src.key not in batch:
                            src._dirty = False
                            batch[src.key] = (src, src._owed_final)
                self._publish(list(batch.values()))

    def _publish(self, batch: list[tuple[Source, bool]]) -> None:
        """Build each source's payload and send them in one ``publish_data`` (caller holds ``_sending``)."""
        if self.error is not None or not batch:
            return
        payloads: dict[str, object] = {}
        try:
            for src, final in batch:
                payload = src._build(final)
                if payload is not None:
                    payloads[src.key] = payload
            if payloads:
                self._send(payloads)
        except Exception as exc:  # noqa: BLE001 - what a rank shows must never break its training: stop publishing
            self.error = f"{type(exc).__name__}: {exc}"
            return
        now = time.monotonic()
        if payloads:
            self._last_sent = now
        for src, final in batch:
            if src.key in payloads:
                src._last_sent = now
                src.sent += 1
            if final:
                src._owed_final = False


_rank_publisher: Publisher | None = None
_made = threading.Lock()


def rank_publisher() -> Publisher | None:
    """This engine's one publisher (made on first use), or None when this process is not an ipyparallel engine."""
    global _rank_publisher
    with _made:
        if _rank_publisher is None:
            send = engine_sender()
            if send is not None:
                _rank_publisher = Publisher(send)
        return _rank_publisher
