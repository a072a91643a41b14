"""The instructor's limits that distlab enforces itself, in a learner's kernel: ranks, labs, the idle end.

A classroom's hub (``spawner``) gives each learner's server ``DISTLAB_LIMITS``, which their kernels
inherit: ``"ranks=4,labs=2,cores=1.5,idle=30m"``, every key optional (:class:`Limits`).

- ``ranks``: the most ranks a learner may have running across all their labs at once (so also the
  largest lab); ``labs``: the most labs running at once. Both are checked before a lab starts, and
  before a restart that grows one, against the labs of this user that the Jupyter runtime folder's
  state files list (``server.registry.read_labs``: every kernel's) and the kept labs nobody holds
  (``notebook.kept``: they run with no kernel, and no state file). A refusal is one line, and
  nothing starts. A lab's companions (``lab.companion(...)``: the exercise grader's labs) are
  distlab's own: they write no state file and are not counted.
- ``idle``: a lab that has run no cell for this long is stopped, and the kernel says so in one line.
  Never while a cell, a start or a stop of it runs: the idle end stops a lab only when it can take
  the lab's lock (``LabCore.stop_unless_busy``), which all of those hold.
- ``cores``: what the hub's control group gives the learner's server; distlab only reads it.

The limits are the class's rules, kept by distlab for a learner who follows them: a learner's own code
runs in the same kernel and could remove them. What holds whatever the code does (cores, memory) is
the hub's control groups. Two kernels starting labs at the same instant may both pass the check:
each counts the other's lab once its state file is written, after its ranks are up.

``front.lab`` imports this module only when ``DISTLAB_LIMITS`` is set.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import LabUsageError
from ..notebook.labs import id_of
from ..notebook.observers import ObservedLab, Observer

__all__ = ["ENV_VAR", "ClassLimits", "Limits", "running_labs"]

ENV_VAR = "DISTLAB_LIMITS"
_FORM = (
    'the form is "ranks=4,labs=2,cores=1.5,idle=30m" (each key optional; ranks and labs whole numbers >= 1, '
    "cores a number > 0, idle seconds or with s, m or h)"
)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Limits:
    """A class's limits; None: no limit. ``str(limits)`` is the text :meth:`parse` reads."""

    #: The most ranks a learner may have running across all their labs at once (so also per lab).
    ranks: int | None = None
    #: The most labs a learner may have running at once.
    labs: int | None = None
    #: Cores the learner's server has (the hub's control group enforces it; distlab only reads it).
    cores: float | None = None
    #: A lab with no cell for this many seconds is stopped.
    idle_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> Limits:
        """``"ranks=4,labs=2,cores=1.5,idle=30m"`` -> Limits. Text that is not of that form raises
        ValueError (``LabUsageError``), one line naming the key or value and the accepted form."""
        if not isinstance(text, str):
            raise LabUsageError(f"limits must be text (got {type(text).__name__}): {_FORM}")
        values: dict[str, Any] = {}
        for item in text.split(","):
            if not item.strip():
                continue  # "ranks=4," as a join of parts may leave
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or not value:
                raise LabUsageError(f"limit {item.strip()!r} has no value: {_FORM}")
            field, read = _KEYS.get(key, (None, None))
            if field is None or read is None:
                raise LabUsageError(f"unknown limit {key!r} in {item.strip()!r}: {_FORM}")
            got = read(key, value)
            if field in values and values[field] != got:
                raise LabUsageError(f"limit {key!r} is given twice, differently ({text.strip()!r}): {_FORM}")
            values[field] = got
        return cls(**values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Limits | None:
        """The limits ``DISTLAB_LIMITS`` sets, or None where it is unset (or empty): no class."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "")
        if not text.strip():
            return None
        try:
            return cls.parse(text)
        except LabUsageError as exc:
            raise LabUsageError(f"{ENV_VAR} (set by the class's hub) is wrong: {exc}") from None

    def to_env(self) -> str:
        """The text :meth:`parse` reads back as these limits (what ``DISTLAB_LIMITS`` holds)."""
        parts = [f"ranks={self.ranks}" if self.ranks is not None else "",
                 f"labs={self.labs}" if self.labs is not None else "",
                 f"cores={self.cores:g}" if self.cores is not None else "",
                 f"idle={duration(self.idle_s)}" if self.idle_s is not None else ""]
        return ",".join(part for part in parts if part)

    def __str__(self) -> str:
        return self.to_env()


def _whole(key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise LabUsageError(f"limit {key}={value!r} must be a whole number >= 1, like {key}=2: {_FORM}")
    return int(value)


def _cores(key: str, value: str) -> float:
    try:
        cores = float(value)
    except ValueError:
        cores = math.nan
    if not math.isfinite(cores) or cores <= 0:
        raise LabUsageError(f"limit {key}={value!r} must be a number > 0, like {key}=1.5: {_FORM}")
    return cores


def _seconds(key: str, value: str) -> float:
    number, unit = (value[:-1], value[-1]) if value[-1:] in _UNITS else (value, "s")
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise LabUsageError(f"limit {key}={value!r} must be a time > 0, like {key}=30m, {key}=2h or {key}=90: {_FORM}")
    return seconds


# key in the text -> (field of Limits, how its value is read)
_KEYS = {"ranks": ("ranks", _whole), "labs": ("labs", _whole), "cores": ("cores", _cores), "idle": ("idle_s", _seconds)}


def duration(seconds: float) -> str:
    """Seconds as the limits write them: whole hours as ``2h``, whole minutes as ``30m``, else ``90s``."""
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


# ---------------------------------------------------------------------------- counting the learner's labs


def running_labs(exclude: str | None = None) -> dict[str, int]:
    """Lab id -> its ranks, for each lab of this user running now on this machine: those with a state
    file (every kernel's ``Lab``), and kept labs let go of (``notebook.kept``: they run with no kernel
    holding them, so with no state file). ``exclude``: a lab not to count (the one restarting)."""
    from ..notebook.kept import kept_labs
    from ..server.registry import read_labs

    found = {str(entry["id"]): int(entry.get("world_size") or len(entry.get("ranks") or ())) for entry in read_labs()}
    for record in kept_labs():  # a kept lab a kernel holds has a state file too: counted once, by id
        found.setdefault(str(record["id"]), len(record["world"]["table"]))
    found.pop(exclude or "", None)
    return found


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


class ClassLimits(Observer):
    """The class's limits on one lab (``front.lab.Lab`` makes one when ``DISTLAB_LIMITS`` is set):
    checked before it starts or grows, and, as its observer, its idle end."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._since = 0.0  # when the lab (re)started: idle from then on until its first cell
        self._done: threading.Event | None = None  # set at stop: the idle watch ends

    @classmethod
    def from_env(cls) -> ClassLimits | None:
        limits = Limits.from_env()
        return None if limits is None else cls(limits)

    # ------------------------------------------------------------------ before processes start

    def check_start(self, lab: ObservedLab) -> None:
        """Refuse (LabUsageError, one line) a start of ``lab`` that would break the class's limits."""
        self._check(lab, lab.world_size, new_lab=True, how="%dist start -n")

    def check_restart(self, lab: ObservedLab, ranks: object) -> None:
        """Refuse a restart of ``lab`` at ``ranks`` that would break them; one that does not grow it is
        let be (a wrong ``ranks`` is the lab's own check to refuse)."""
        if isinstance(ranks, int) and not isinstance(ranks, bool) and ranks > lab.world_size:
            self._check(lab, ranks, new_lab=False, how="%dist restart -n", more=ranks - lab.world_size)

    def _check(self, lab: ObservedLab, ranks: int, new_lab: bool, how: str, more: int | None = None) -> None:
        limit = self.limits
        if limit.ranks is not None and ranks > limit.ranks:
            raise LabUsageError(
                f"{_ranks(ranks)} is over this class's limit of {_ranks(limit.ranks)} per learner: "
                f"use at most {limit.ranks} ({how} {limit.ranks})"
            )
        if limit.ranks is None and (limit.labs is None or not new_lab):
            return  # nothing to count: spare the state files' read
        others = running_labs(exclude=id_of(lab))
        if new_lab and limit.labs is not None and len(others) >= limit.labs:
            names = ", ".join(sorted(others))
            raise LabUsageError(
                f"this class allows {limit.labs} running lab{'s' if limit.labs != 1 else ''} per learner, and "
                f"{len(others)} {'is' if len(others) == 1 else 'are'} running ({names}): stop one with %dist stop"
            )
        total = sum(others.values()) + ranks
        if limit.ranks is not None and total > limit.ranks:
            added = ranks if more is None else more
            raise LabUsageError(
                f"{added} more rank{'s' if added != 1 else ''} would make {total} running, over this class's "
                f"limit of {_ranks(limit.ranks)} per learner: stop a lab (%dist stop) or start fewer ranks"
            )

    # ------------------------------------------------------------------------------ idle end

    def started(self, lab: ObservedLab) -> None:
        self._since = time.time()
        if self.limits.idle_s is None:
            return
        if self._done is not None:
            self._done.set()  # a watch of an earlier start that has not seen its stop yet
        done = self._done = threading.Event()
        threading.Thread(target=self._watch, args=(lab, done), daemon=True, name="distlab-idle-end").start()

    def restarted(self, lab: ObservedLab) -> None:
        self._since = time.time()

    def stopped(self, lab: ObservedLab) -> None:
        if self._done is not None:
            self._done.set()

    def idle_for(self, lab: ObservedLab) -> float:
        """Seconds since the lab's last cell ended (or since it started or restarted, if later)."""
        return time.time() - max(self._since, lab.last_cell_at or 0.0)

    def _watch(self, lab: ObservedLab, done: threading.Event) -> None:
        idle_s = self.limits.idle_s
        assert idle_s is not None
        every = min(5.0, max(0.5, idle_s / 4))  # an idle lab goes within a quarter of the limit (5 s at most)
        while not done.wait(every):
            if self.idle_for(lab) < idle_s:
                continue
            try:
                # Under the lab's lock, asked again: a cell that began meanwhile keeps the lab.
                stopped = lab.stop_unless_busy(lambda: self.idle_for(lab) >= idle_s)
            except Exception as exc:  # noqa: BLE001 - a companion failed to stop: the lab itself has
                print(f"[distlab] stopping the idle lab {id_of(lab)}: {exc}", flush=True)
                stopped = not lab.running
            if stopped:
                print(
                    f"[distlab] lab {id_of(lab)} stopped: no cell for {duration(idle_s)}, this class's idle limit "
                    f"(its engines and controller are gone); %dist start -n {lab.world_size} starts a new one",
                    flush=True,
                )
                return
