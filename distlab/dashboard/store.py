"""The notebook's copy of the ranks' telemetry: merged by (rank, step), bounded, fed by the Lab.

Each rank publishes overlapping windows of its recent steps (``distlab.telemetry``); the client
sees only the latest publish per rank, in ``AsyncResult.data``. The store merges every window it
sees into one record per (rank, step), keeps the last ``max_steps`` per rank, and tells its
subscribers when something changed. It imports nothing heavy: a lab creates it on first use.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from ..records import PUBLISH_KEY, Publish, StepRecord, WatchMeta, record_key

if TYPE_CHECKING:
    from ..ipycompat import IppAsyncResult

__all__ = ["KEY", "TelemetryStore"]

#: The key ranks publish under (``distlab.records``, which imports no torch: shared with the ranks).
KEY = PUBLISH_KEY

Subscriber = Callable[[bool], None]


class TelemetryStore:
    """Telemetry of the ranks' latest watch, one record per rank and step.

    ``on_poll`` is the Lab listener (``lab.add_listener``); ``records()`` is the data; subscribers
    (the dashboard, the ``%%ddp`` auto-display) are called with ``final`` after each change.
    """

    def __init__(self, world_size: int, max_steps: int = 2000) -> None:
        self.world_size = world_size
        self.max_steps = max_steps
        #: Bumped on every change; views compare it to what they last drew.
        self.version = 0
        self._steps: dict[int, OrderedDict[int, StepRecord]] = {}
        self._meta: dict[int, WatchMeta] = {}
        self._seen: dict[int, tuple[str, int]] = {}  # rank -> (run, seq) of the last publish merged
        self._subscribers: list[Subscriber] = []
        #: The dashboard drawn from this store, made on first ``lab.dashboard()``.
        self.view: Any = None

    # ------------------------------------------------------------------ feeding

    def on_poll(self, pending: dict[int, Any], final: bool) -> None:
        """Lab listener: merge what each running rank last published; never raises."""
        changed = False
        for ar in pending.values():
            payload = _payload_of(ar)
            if payload is not None:
                changed |= self.merge(payload)
        if changed or final:
            self._notify(final)

    def backfill(self, published: Iterable[Any]) -> None:
        """Merge payloads found in ipyparallel's per-task metadata (``client.metadata.values()``)."""
        changed = False
        for md in published:
            data = md.get("data") if hasattr(md, "get") else None
            payload = data.get(KEY) if isinstance(data, dict) else None
            if isinstance(payload, dict):
                changed |= self.merge(cast(Publish, payload))  # a rank's publish: merge checks its keys
        if changed:
            self._notify(False)

    def merge(self, payload: Publish) -> bool:
        """Merge one rank's publish; True if it brought anything new."""
        try:
            rank, run, seq = int(payload["rank"]), str(payload["run"]), int(payload["seq"])
        except (KeyError, TypeError, ValueError):
            return False
        if self._seen.get(rank) == (run, seq):
            return False
        previous = self._seen.get(rank)
        if previous is not None and previous[0] == run and previous[1] > seq:
            return False  # an older publish seen late (backfill): the newer one already covers it
        self._seen[rank] = (run, seq)
        steps = self._steps.get(rank)
        meta = self._meta.get(rank)
        if steps is None or meta is None or meta.get("run") != run:
            steps = self._steps[rank] = OrderedDict()  # a new watch on this rank starts afresh
        self._meta[rank] = cast(WatchMeta, dict(payload.get("meta") or {}, run=run))
        for record in payload.get("records") or ():
            step = record.get("step")
            if isinstance(step, int):
                steps[step] = record
                steps.move_to_end(step)
        if len(steps) > self.max_steps:
            for step in sorted(steps)[: len(steps) - self.max_steps]:
                del steps[step]
        self.version += 1
        return True

    def clear(self) -> None:
        self._steps.clear()
        self._meta.clear()
        self._seen.clear()
        self.version += 1
        self._notify(False)

    # ------------------------------------------------------------------ reading

    def records(self, rank: int | None = None) -> list[StepRecord]:
        """One dict per rank per recorded step, ordered by step then rank (``distlab.records.StepRecord``)."""
        ranks = sorted(self._steps) if rank is None else [rank]
        rows = [rec for r in ranks for rec in self._steps.get(r, {}).values()]
        return sorted(rows, key=record_key)

    def meta(self) -> dict[int, WatchMeta]:
        """{rank: what its watch said about itself: layers, gradient bytes, initial checksums, notes}."""
        return {rank: cast(WatchMeta, dict(m)) for rank, m in sorted(self._meta.items())}

    def ranks(self) -> list[int]:
        return sorted(self._steps)

    def __len__(self) -> int:
        return sum(len(steps) for steps in self._steps.values())

    def __repr__(self) -> str:
        return f"<TelemetryStore: {len(self)} records from ranks {self.ranks()}>"

    # ------------------------------------------------------------------ subscribers

    def subscribe(self, fn: Subscriber) -> None:
        if fn not in self._subscribers:
            self._subscribers.append(fn)

    def unsubscribe(self, fn: Subscriber) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(fn)

    def _notify(self, final: bool) -> None:
        for fn in list(self._subscribers):
            try:
                fn(final)
            except Exception as exc:  # noqa: BLE001 - a broken view must not break the cell it watches
                self.unsubscribe(fn)
                _warn_once(f"distlab: a telemetry view failed and was detached: {type(exc).__name__}: {exc}")


def _payload_of(ar: IppAsyncResult) -> Publish | None:
    try:
        data = ar.data
    except Exception:  # noqa: BLE001 - a dead engine's result may not answer
        return None
    payload = data.get(KEY) if isinstance(data, dict) else None
    # What a rank published under distlab's key: a Publish (merge checks its keys).
    return cast(Publish, payload) if isinstance(payload, dict) else None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    import warnings

    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
