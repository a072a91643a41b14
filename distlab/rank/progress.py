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
bars this rank shows in the cell. A daemon thread sends at most one per ``PUBLISH_INTERVAL_S``
(tqdm itself redraws at most every ``mininterval``); the cell's end sends the final state
(:func:`flush`, from ``rank.cell``), and starts the next cell with no bars.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..wire import PROGRESS_KEY, ProgressBar, ProgressPublish
from . import hooks

__all__ = ["PUBLISH_INTERVAL_S", "flush", "install", "installed", "uninstall"]

#: Seconds between two publishes of one rank, at least: ten a second at most, however many bars.
PUBLISH_INTERVAL_S = 0.1
#: Bars one rank shows at most: all the open ones, then the latest closed ones that still fit
#: (nested loops that leave every inner bar would otherwise add a row per epoch).
MAX_BARS = 8
#: How long a cell's end waits for a publish in progress before giving up on its own.
_SEND_WAIT_S = 2.0

#: The names made distlab's, per module: (bar class names, range function names).
_NAMES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tqdm": (("tqdm",), ("trange",)),
    "tqdm.auto": (("tqdm",), ("trange",)),
    "tqdm.autonotebook": (("tqdm",), ("trange",)),
    "tqdm.notebook": (("tqdm", "tqdm_notebook"), ("trange", "tnrange")),
}

Sender = Callable[[dict[str, ProgressPublish]], None]


@dataclass
class _Entry:
    state: ProgressBar
    #: False for a bar that closed and does not stay (tqdm's ``leave``).
    shown: bool
    bar: weakref.ref[Any]
    #: Moved in the running cell: a bar left open by an earlier cell is shown again once it moves.
    active: bool = True


class _Reporter:
    """This rank's bars, those of the running cell shown, and the thread that publishes them."""

    def __init__(self, rank: int, send: Sender, interval_s: float) -> None:
        self.rank = rank
        self._send = send
        self._interval_s = interval_s
        # Reentrant: a bar closed by the garbage collector reports from whatever this thread was doing.
        self._lock = threading.RLock()
        self._sending = threading.Lock()  # one publish at a time: the thread's, or a flush
        self._bars: dict[int, _Entry] = {}  # by id: in the order the bars were made
        self._dirty = threading.Event()
        self._seq = 0
        self._last_sent = float("-inf")
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def report(self, bar: Any, state: ProgressBar, shown: bool = True) -> None:
        """A bar changed (``shown`` False: it closed and does not stay)."""
        with self._lock:
            entry = self._bars.get(state["id"])
            if entry is None:
                self._bars[state["id"]] = _Entry(state, shown, weakref.ref(bar))
            else:
                entry.state, entry.shown, entry.active = state, shown, True
            self._dirty.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="distlab-progress", daemon=True)
                self._thread.start()

    def payload(self) -> ProgressPublish:
        with self._lock:
            shown = [e.state for e in self._bars.values() if e.active and e.shown]
        open_ = sum(1 for s in shown if not s["closed"])
        closed = [s for s in shown if s["closed"]]
        dropped = {s["id"] for s in closed[: max(0, len(closed) - max(0, MAX_BARS - open_))]}  # the oldest
        self._seq += 1
        return {"rank": self.rank, "seq": self._seq, "bars": [s for s in shown if s["id"] not in dropped]}

    def _loop(self) -> None:
        while True:
            self._dirty.wait()
            wait_s = self._last_sent + self._interval_s - time.monotonic()
            if wait_s > 0:
                time.sleep(wait_s)
            with self._sending:
                if self._dirty.is_set():  # else a cell's end has just sent it
                    self._dirty.clear()
                    self._publish()

    def _publish(self) -> None:
        if self.error is not None:
            return
        try:
            self._send({PROGRESS_KEY: self.payload()})
        except Exception as exc:  # noqa: BLE001 - a progress bar must never break training: stop publishing
            self.error = f"{type(exc).__name__}: {exc}"
        self._last_sent = time.monotonic()

    def _catch_up(self) -> bool:
        """Read the open bars once more (tqdm draws, and so reports, at most every ``mininterval``: a
        bar's last steps may not be reported yet); True if any bar moved in the cell."""
        with self._lock:
            for entry in self._bars.values():
                bar = entry.bar()
                if bar is None or entry.state["closed"] or getattr(bar, "disable", True):
                    continue
                with contextlib.suppress(Exception):
                    state = bar._distlab_state(False)
                    if entry.active or _moved(entry.state, state):
                        entry.state, entry.active = state, True
            return any(e.active for e in self._bars.values())

    def flush(self) -> None:
        """The cell is ending: send its bars' last state now (before the reply); the next cell
        starts with none (a bar left open comes back when it moves)."""
        if not self._bars:
            return  # tqdm never used on this rank: the cost of every cell's end
        if not self._sending.acquire(timeout=_SEND_WAIT_S):
            return  # a send that never returns: the thread's publish carries what it can
        try:
            if not self._catch_up():
                return
            self._dirty.clear()
            self._publish()
            with self._lock:
                for key, entry in list(self._bars.items()):
                    if entry.state["closed"] or entry.bar() is None:
                        del self._bars[key]
                    else:
                        entry.active = False
        finally:
            self._sending.release()


def _moved(before: ProgressBar, now: ProgressBar) -> bool:
    return any(before[k] != now[k] for k in ("n", "total", "desc", "postfix"))  # type: ignore[literal-required]


_reporter: _Reporter | None = None
_ids = itertools.count()
_bar_class: type | None = None
_originals: dict[tuple[str, str], Any] = {}  # (module, name) -> what tqdm had there
_hooked_modules: list[str] = []  # modules this patch made as they were imported
_finder: _PatchOnImport | None = None


class _Nowhere:
    """The file a bar writes to: nothing it writes goes anywhere (it has no ``isatty``, so tqdm stays on)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _number(value: Any) -> int | float:
    number = float(value)
    return int(number) if number.is_integer() else number


def _make_bar_class() -> type:
    """distlab's bar, made once tqdm is imported: a ``tqdm.std.tqdm`` (through tqdm.asyncio, so
    ``async for`` works as with ``tqdm.auto``) that reports instead of drawing."""
    from tqdm.asyncio import tqdm_asyncio

    class RankBar(tqdm_asyncio):  # type: ignore[misc, valid-type]
        """tqdm on a distlab rank: drawn in the notebook, one widget for every rank's bars."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._distlab_id = next(_ids)
            kwargs.pop("display", None)  # tqdm.notebook's own: whether to display the widget at once
            kwargs["file"] = _Nowhere()
            super().__init__(*args, **kwargs)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
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
            return {
                "id": self._distlab_id,
                "n": n,
                "total": None if total is None else _number(total),
                "desc": str(self.desc or ""),
                "unit": str(fd.get("unit") or "it"),
                "unit_scale": fd.get("unit_scale") if isinstance(fd.get("unit_scale"), (bool, int, float)) else False,
                "postfix": str(fd.get("postfix") or ""),
                "elapsed": elapsed,
                "rate": None if rate is None else float(rate),
                "closed": closed,
            }

    RankBar.__module__ = __name__
    RankBar.__qualname__ = "RankBar"
    return RankBar


def _report(bar: Any, closed: bool, shown: bool = True) -> None:
    reporter = _reporter
    if reporter is not None:
        with contextlib.suppress(Exception):  # a progress bar must never break the loop it counts
            reporter.report(bar, bar._distlab_state(closed), shown)


def _rank_bar() -> type:
    global _bar_class
    if _bar_class is None:
        _bar_class = _make_bar_class()
    return _bar_class


def _trange(*args: Any, **kwargs: Any) -> Any:
    """``tqdm(range(*args), **kwargs)``, drawn in the notebook."""
    return _rank_bar()(range(*args), **kwargs)


def _patch(module: Any) -> None:
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

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        if self._name == "tqdm.autonotebook":
            module.__all__ = ["tqdm", "trange"]
        else:
            self._loader.exec_module(module)
        _hooked_modules.append(self._name)
        _patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... as the real loader has them
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds tqdm's modules as the other finders do, and hands them to a patching loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
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

    Only on an ipyparallel engine (``send`` defaults to its ``publish_data``): elsewhere (a script
    that torchrun runs) tqdm is left as it is. Called again (a rebuilt group), it only updates ``rank``.
    """
    global _reporter, _finder
    if send is None:
        from ..telemetry.publish import engine_sender  # None off an engine, found without importing ipyparallel

        send = engine_sender()  # type: ignore[assignment]
        if send is None:
            return False
    if _reporter is not None and _finder is not None:
        _reporter.rank = rank
        return True
    _reporter = _Reporter(rank, send, PUBLISH_INTERVAL_S)
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
