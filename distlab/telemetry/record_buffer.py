"""The steps a watch has recorded, as its publisher thread reads them (``telemetry/watch.py``).

The watch's hooks run on the training thread; the publisher sends from a thread of its own. What both
touch is here, under one lock: the last ``buffer_steps`` final records, the latest record (still open
to values logged and collectives run after its update), and the ids of GPU records that wait for the
GPU (held back from publishing). A record is never changed in place once made: it is replaced
(copy-on-write), since the publisher thread may be reading the old dict.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import Any, cast

from ..records import StepRecord
from .pending import PendingSteps
from .steps import Step

__all__ = ["RecordBuffer"]


class RecordBuffer:
    """A watch's records: the final ones, oldest first, and the latest; see the module."""

    def __init__(self, buffer_steps: int, window_steps: int) -> None:
        self._lock = threading.Lock()
        self._done: deque[StepRecord] = deque(maxlen=buffer_steps)
        self._latest: StepRecord | None = None
        self._marks: deque[int] = deque(maxlen=2)  # newest finished step in each of the last 2 publishes
        self._window_steps = window_steps
        self.pending = PendingSteps()  # GPU steps whose records wait for the GPU (telemetry/pending.py)

    def __len__(self) -> int:
        return len(self._done) + (self._latest is not None)

    def all(self) -> list[StepRecord]:
        """Every record kept, oldest first, the latest last."""
        with self._lock:
            out = list(self._done)
            if self._latest is not None:
                out.append(self._latest)
        return out

    def window(self, final: bool) -> list[StepRecord]:
        """What one publish carries: the steps since the one before last (all of them when final)."""
        with self._lock:
            # Records still waiting for the GPU are the newest: they go in a later publish.
            done = [r for r in self._done if id(r) not in self.pending.record_ids]
            latest = self._latest if id(self._latest) not in self.pending.record_ids else None
        if final:
            window = done
        else:
            since = self._marks[0] if len(self._marks) == 2 else -1
            window = [r for r in done if r["step"] > since][-self._window_steps :]
        if done:
            self._marks.append(done[-1]["step"])
        if latest is not None:
            window.append(latest)
        return window

    def closed(self, record: StepRecord, waits_for_gpu: bool) -> None:
        """A step closed with ``record``: the latest, held back while it ``waits_for_gpu``."""
        with self._lock:
            if waits_for_gpu:
                self.pending.record_ids.add(id(record))
            self._latest = record

    def replace(self, old: StepRecord, new: StepRecord) -> None:
        """A GPU step's record completed: ``new`` stands where ``old`` was kept, and is published."""
        with self._lock:
            if self._latest is old:
                self._latest = new
            elif (i := next((i for i, r in enumerate(self._done) if r is old), None)) is not None:
                self._done[i] = new
            self.pending.record_ids.discard(id(old))

    def amend(self, step: Step, fields: Mapping[str, object]) -> None:
        """Give a closed step a new record with ``fields`` changed, where it is kept."""
        old = step.record
        step.record = cast(StepRecord, {**cast(dict[str, Any], old), **fields})
        with self._lock:
            if self._latest is old:
                self._latest = step.record

    def waits_for_gpu(self, record: StepRecord) -> bool:
        return id(record) in self.pending.record_ids

    def keep(self, record: StepRecord) -> None:
        """``record`` is final: among the last ``buffer_steps``, no longer the latest."""
        with self._lock:
            self._done.append(record)
            if self._latest is record:
                self._latest = None
