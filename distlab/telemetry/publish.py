"""Rate-limited publishing from a rank to the notebook, off the training thread.

The training thread only marks new data; a daemon thread sends at most one ``publish_data`` per
interval. ipyparallel keeps the latest dict per key on the client (``AsyncResult.data``), so each
publish carries an overlapping window of recent steps: a publish the client polls too late to see
loses nothing that the next one does not carry again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..records import PUBLISH_KEY, Publish

__all__ = ["KEY", "Publisher", "engine_sender"]

#: The key of distlab's telemetry in ``AsyncResult.data``.
KEY = PUBLISH_KEY

#: ipyparallel's ``publish_data``: {KEY: one publish}.
Sender = Callable[[dict[str, Publish]], None]

#: How long a publish waits for another one in progress (the thread's, or a flush) before giving up.
_SEND_WAIT_S = 2.0


def engine_sender() -> Sender | None:
    """ipyparallel's ``publish_data`` when this process is an ipyparallel engine, else None."""
    from .. import ipycompat

    if not ipycompat.on_engine():
        return None
    from ipyparallel.datapub import publish_data

    return publish_data  # type: ignore[no-any-return]


class Publisher:
    """Sends ``build(final)`` through ``send`` at most once per ``interval_s``, from a daemon thread.

    Its sends go out on the engine's IOPub thread (thread-safe), under the request the engine is
    serving, so they reach the cell's AsyncResult while the cell runs.
    """

    def __init__(self, build: Callable[[bool], Publish], send: Sender, interval_s: float) -> None:
        self._build = build
        self._send = send
        self._interval_s = interval_s
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._last_sent = 0.0
        self._sending = threading.Lock()  # one build-and-send at a time: the thread's, or a flush
        self._owed_final = False  # a final publish that could not go out yet: the thread sends it
        self.sent = 0
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="distlab-telemetry", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """New data: send it within one interval."""
        self._dirty.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._dirty.wait(timeout=1.0):
                continue
            # Rate limit: wait out the rest of the interval (a stop request cuts it short).
            wait_s = self._last_sent + self._interval_s - time.monotonic()
            if wait_s > 0 and self._stop.wait(wait_s):
                return
            self._dirty.clear()
            self._publish(final=self._owed_final)

    def _publish(self, final: bool) -> None:
        # Bounded wait: a send that never returns must not hold a cell's end (flush) or close forever.
        if not self._sending.acquire(timeout=_SEND_WAIT_S):
            # Owe it rather than drop it: the thread sends it (the whole buffer, if this was a
            # final one) once the send in the way returns.
            self._owed_final = self._owed_final or final
            self._dirty.set()
            return
        try:
            if self.error is not None:
                return
            try:
                self._send({KEY: self._build(final)})
            except Exception as exc:  # noqa: BLE001 - telemetry must never break training: stop publishing
                self.error = f"{type(exc).__name__}: {exc}"
                return
            self._last_sent = time.monotonic()
            self.sent += 1
            if final:
                self._owed_final = False
        finally:
            self._sending.release()

    def flush(self) -> None:
        """Send everything now, from the caller's thread, and keep publishing afterwards.

        The cell is ending: what is sent before the cell's reply reaches the notebook with it.
        """
        self._dirty.clear()
        self._publish(final=True)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread, then send everything once more (the whole buffer), from the caller's thread."""
        self._stop.set()
        self._dirty.set()
        self._thread.join(timeout_s)
        self._publish(final=True)
