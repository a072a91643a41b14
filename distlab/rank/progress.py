"""tqdm on a rank: bars that draw nothing there and report their state to the notebook instead.

A bar a rank draws itself is lost: tqdm's terminal bar is a stream of carriage returns on the
rank's stderr, and its notebook widget would be displayed in the engine, where no front end sees
it. So on an ipyparallel engine :func:`install` (``rank.group.init_rank``, before any cell) makes
tqdm's public names distlab's :class:`RankBar`, a ``tqdm.std.tqdm`` that writes nothing and reports
``n``, ``total``, ``desc``, the rate, ... through ipyparallel's ``publish_data`` under
``wire.PROGRESS_KEY``; the notebook draws every rank's bars in one widget (``dashboard.progress``).
The names are ``tqdm.tqdm`` and ``tqdm.trange``, and those of ``tqdm.auto``, ``tqdm.autonotebook``
and ``tqdm.notebook``; ``tqdm.std.tqdm`` stays the base class. Modules already imported are
patched at once, the others as they are imported, so a rank that never uses tqdm pays nothing.

ipyparallel keeps only the latest value of each key on the client, so each publish carries all the
bars this rank shows in the cell. They publish through the rank's one publisher (``rank/publish.py``,
shared with a watch's telemetry): at most one publish per ``PUBLISH_INTERVAL_S`` (tqdm itself redraws
at most every ``mininterval``); the cell's end sends the final state (:func:`flush`), and starts the
next cell with no bars.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import itertools
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Protocol, SupportsFloat, SupportsIndex

from ..wire import PROGRESS_KEY, ProgressBar, ProgressPublish
from . import hooks
from .publish import PUBLISH_INTERVAL_S, Publisher, Sender, rank_publisher

__all__ = ["PUBLISH_INTERVAL_S", "flush", "install", "installed", "uninstall"]

#: Bars one rank shows at most: all the open ones, then the latest closed ones that still fit
#: (nested loops that leave every inner bar would otherwise add a row per epoch).
MAX_BARS = 8

#: The names made distlab's, per module: (bar class names, range function names).
_NAMES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tqdm": (("tqdm",), ("trange",)),
    "tqdm.auto": (("tqdm",), ("trange",)),
    "tqdm.autonotebook": (("tqdm",), ("trange",)),
    "tqdm.notebook": (("tqdm", "tqdm_notebook"), ("trange", "tnrange")),
}

class _Bar(Protocol):
    """A bar as the reporter reads it (distlab's ``RankBar``)."""

    def _distlab_state(self, closed: bool) -> ProgressBar: ...


@dataclass
class _Entry:
    state: ProgressBar
    #: False for a bar that closed and does not stay (tqdm's ``leave``).
    shown: bool
    bar: weakref.ref[_Bar]
    #: Moved in the running cell: a bar left open by an earlier cell is shown again once it moves.
    active: bool = True


class _Reporter:
    """This rank's bars, those of the running cell shown; they publish as a source of the rank's publisher."""

    def __init__(self, rank: int, publisher: Publisher) -> None:
        self.rank = rank
        # Reentrant: a bar closed by the garbage collector reports from whatever this thread was doing.
        self._lock = threading.RLock()
        self._bars: dict[int, _Entry] = {}  # by id: in the order the bars were made
        self._seq = 0
        self.publisher = publisher
        self._source = publisher.source(PROGRESS_KEY, self._build, PUBLISH_INTERVAL_S)

    def report(self, bar: _Bar, state: ProgressBar, shown: bool = True) -> None:
        """A bar changed (``shown`` False: it closed and does not stay)."""
        with self._lock:
            entry = self._bars.get(state["id"])
            if entry is None:
                self._bars[state["id"]] = _Entry(state, shown, weakref.ref(bar))
            else:
                entry.state, entry.shown, entry.active = state, shown, True
        self._source.notify()

    def payload(self) -> ProgressPublish:
        with self._lock:
            shown = [e.state for e in self._bars.values() if e.active and e.shown]
        open_ = sum(1 for s in shown if not s["closed"])
        closed = [s for s in shown if s["closed"]]
        dropped = {s["id"] for s in closed[: max(0, len(closed) - max(0, MAX_BARS - open_))]}  # the oldest
        self._seq += 1
        return {"rank": self.rank, "seq": self._seq, "bars": [s for s in shown if s["id"] not in dropped]}

    def _build(self, final: bool) -> ProgressPublish | None:
        """What a publish carries: the shown bars; at the cell's end (final) their last state, then none.

        Nothing (None) at a cell's end when no bar moved in the cell: the cost of every cell's end.
        """
        if not final:
            return self.payload()
        if not self._catch_up():
            return None
        payload = self.payload()
        with self._lock:  # the next cell starts with none: a bar left open comes back when it moves
            for key, entry in list(self._bars.items()):
                if entry.state["closed"] or entry.bar() is None:
                    del self._bars[key]
                else:
                    entry.active = False
        return payload

    def _catch_up(self) -> bool:
        """Read the open bars once more (tqdm draws, and so reports, at most every ``mininterval``: a
        bar's last steps may not be reported yet); True if any bar moved in the cell."""
        with self._lock:
            for entry in self._bars.values():
                bar = entry.bar()
                if bar is None or entry.state["closed"] or getattr(bar, "disable", True):
                    continue
                with contextlib.suppress(Exception):  # a user's bar in any state: a failed read skips it
                    state = bar._distlab_state(False)
                    if entry.active or _moved(entry.state, state):
                        entry.state, entry.active = state, True
            return any(e.active for e in self._bars.values())

    def flush(self) -> None:
        """The cell is ending: send its bars' last state now (before the reply); a send in the way that
        never returns leaves it to the publishes of the bars' next moves."""
        if self._bars:  # else tqdm was never used on this rank
            self._source.flush()

    def close(self) -> None:
        """Publish nothing more (sending the last state first); a publisher made for these bars alone stops."""
        self._source.close()
        if self.publisher is not rank_publisher():
            self.publisher.close()


def _moved(before: ProgressBar, now: ProgressBar) -> bool:
    return any(before[k] != now[k] for k in ("n", "total", "desc", "postfix"))


_reporter: _Reporter | None = None
_ids = itertools.count()
_bar_class: type | None = None
_originals: dict[tuple[str, str], object] = {}  # (module, name) -> what tqdm had there
_hooked_modules: list[str] = []  # modules this patch made as they were imported
_finder: _PatchOnImport | None = None


class _Nowhere:
    """The file a bar writes to: nothing it writes goes anywhere (it has no ``isatty``, so tqdm stays on)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _number(value: SupportsFloat) -> int | float:
    number = float(value)
    return int(number) if number.is_integer() else number


def _make_bar_class() -> type:
    """distlab's bar, made once tqdm is imported: a ``tqdm.std.tqdm`` (through tqdm.asyncio, so
    ``async for`` works as with ``tqdm.auto``) that reports instead of drawing."""
    from tqdm.asyncio import tqdm_asyncio

    # tqdm's classes are generic in its stub only: tqdm_asyncio[int] would fail at run time.
    class RankBar(tqdm_asyncio):  # type: ignore[type-arg]  # generic in the stub only (above)
        """tqdm on a distlab rank: drawn in the notebook, one widget for every rank's bars."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._distlab_id = next(_ids)
            kwargs.pop("display", None)  # tqdm.notebook's own: whether to display the widget at once
            kwargs["file"] = _Nowhere()
            super().__init__(*args, **kwargs)

        # True as tqdm's own display returns (its close reads it); the stub says None.
        def display(  # type: ignore[override]  # tqdm's stub says None
            self, msg: str | None = None, pos: int | None = None
        ) -> bool:
            if msg != "":  # "" clears a bar that does not stay: its close says so
                _report(self, closed=False)
            return True

        def close(self) -> None:
            if getattr(self, "disable", True):
                return
            # tqdm's rule for what stays: ``leave``, or (leave=None) only a bar at the top position;
            # and a bar closed before its ``delay`` passed was never shown at all.
            stays = abs(getattr(self, "pos", 0)) == 0 if self.leave is None else bool(self.leave)
            stays = stays and getattr(self, "last_print_t", 0) >= getattr(self, "start_t", 0) + (self.delay or 0)
            super().close()  # a bar that stays is drawn once more, with its average rate
            _report(self, closed=True, shown=stays)

        def _distlab_state(self, closed: bool) -> ProgressBar:
            fd = self.format_dict
            elapsed = float(fd.get("elapsed") or 0.0)
            n = _number(fd.get("n") or 0)
            rate = fd.get("rate")
            if rate is None and elapsed > 0:
                rate = (n - (fd.get("initial") or 0)) / elapsed
            total = fd.get("total")
            unit_scale = fd.get("unit_scale")
            return {
                "id": self._distlab_id,
                "n": n,
                "total": None if total is None else _number(total),
                "desc": str(self.desc or ""),
                "unit": str(fd.get("unit") or "it"),
                "unit_scale": unit_scale if isinstance(unit_scale, (bool, int, float)) else False,
                "postfix": str(fd.get("postfix") or ""),
                "elapsed": elapsed,
                "rate": None if rate is None else float(rate),
                "closed": closed,
            }

    RankBar.__module__ = __name__
    RankBar.__qualname__ = "RankBar"
    return RankBar


def _report(bar: _Bar, closed: bool, shown: bool = True) -> None:
    reporter = _reporter
    if reporter is not None:
        with contextlib.suppress(Exception):  # a progress bar must never break the loop it counts
            reporter.report(bar, bar._distlab_state(closed), shown)


def _rank_bar() -> type:
    global _bar_class
    if _bar_class is None:
        _bar_class = _make_bar_class()
    return _bar_class


def _trange(*args: SupportsIndex, **kwargs: Any) -> object:
    """``tqdm(range(*args), **kwargs)``, drawn in the notebook."""
    return _rank_bar()(range(*args), **kwargs)


def _patch(module: ModuleType) -> None:
    bars, ranges = _NAMES[module.__name__]
    for name in (*bars, *ranges):
        key = (module.__name__, name)
        if key not in _originals:
            _originals[key] = getattr(module, name, None)
        setattr(module, name, _rank_bar() if name in bars else _trange)


class _PatchingLoader(importlib.abc.Loader):
    """Runs a tqdm module as its own loader would, then patches it. ``tqdm.autonotebook`` is not run:
    it only chooses between tqdm's terminal and notebook bars (importing ipywidgets on the rank to
    see if it can draw a widget there), and on a rank the choice is distlab's bar."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if self._name == "tqdm.autonotebook":
            vars(module)["__all__"] = ["tqdm", "trange"]  # the module as tqdm.autonotebook names it
        else:
            self._loader.exec_module(module)
        _hooked_modules.append(self._name)
        _patch(module)

    def __getattr__(self, name: str) -> object:  # get_source, is_package, ... as the real loader has them
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds tqdm's modules as the other finders do, and hands them to a patching loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _NAMES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


def install(rank: int, send: Sender | None = None) -> bool:
    """Make tqdm's bars on this rank report to the notebook; True if they do.

    Only on an ipyparallel engine (the bars publish through its one publisher, ``rank_publisher``;
    ``send``: through a publisher of their own instead): elsewhere (a script that torchrun runs) tqdm
    is left as it is. Called again (a rebuilt group), it only updates ``rank``.
    """
    global _reporter, _finder
    publisher = Publisher(send) if send is not None else rank_publisher()  # None off an engine
    if publisher is None:
        return False
    if _reporter is not None and _finder is not None:
        _reporter.rank = rank
        return True
    _reporter = _Reporter(rank, publisher)
    for name in _NAMES:
        module = sys.modules.get(name)
        if module is not None:
            _patch(module)
    _finder = _PatchOnImport()
    sys.meta_path.insert(0, _finder)
    return True


def installed() -> bool:
    return _finder is not None


@hooks.at_cell_end  # rank/cell.py calls it when a cell ends
def flush() -> None:
    """Send the state of the cell's bars before its reply; nothing when no bar was made or moved."""
    reporter = _reporter
    if reporter is not None:
        reporter.flush()


def uninstall() -> None:
    """Put tqdm's own names back, and forget the modules made while patched (a test's cleanup)."""
    global _reporter, _finder
    if _finder is not None:
        sys.meta_path.remove(_finder)
    if _reporter is not None:
        _reporter.close()
    for name in _hooked_modules:
        sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
            delattr(sys.modules[parent], child)
    for (module_name, name), value in _originals.items():
        module = sys.modules.get(module_name)
        if module is not None and module_name not in _hooked_modules:
            setattr(module, name, value)
    _hooked_modules.clear()
    _originals.clear()
    _reporter = _finder = None
