"""What a view in one cell's output has in common (``progress.CellProgress``, ``healing.CellHealing``):
drawn live as a widget while the cell runs where this process is a kernel, within a budget of
redraws; at the cell's end its display becomes text and HTML, which the saved notebook keeps
(outside a kernel the text is printed); a view that breaks is left, with a warning, never the cell.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["CellView", "in_kernel"]


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (a front end shows its widgets)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


class CellView:
    """One cell's view. ``live``: draw the widget while the cell runs (default: when this process is a
    kernel); else the text is printed at the end. Subclasses draw (``_draw``) and say what the end
    shows (``_final``); ``what`` names the view in the warning if it breaks."""

    what = "view"

    def __init__(self, clock: Callable[[], float] = time.monotonic, live: bool | None = None) -> None:
        self._clock = clock
        self._live = live
        self._dirty = False
        self._done = False
        self.view: Any = None  # the widget once displayed
        self._handle: Any = None

    def _is_live(self) -> bool:
        if self._live is None:
            self._live = in_kernel()
        return self._live

    def redraw(self) -> None:
        """Draw what changed, unless the view has ended; never raises."""
        if not self._dirty or self._done:
            return
        try:
            self._draw()
        except Exception as exc:  # noqa: BLE001 - a broken view must not break the cell it shows
            self._fail(exc)

    def _draw(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """The cell has ended: show the view's last state as text and HTML (the widget's display becomes it)."""
        if self._done:
            return
        self._done = True
        try:
            bundle = self._final()
            if bundle is not None:
                self._show(bundle)
        except Exception as exc:  # noqa: BLE001 - the cell's own result matters more than this view
            self._fail(exc)

    def _final(self) -> dict[str, str] | None:
        """The end's text and HTML (``text/plain``, ``text/html``), or None to show nothing."""
        raise NotImplementedError

    def _show(self, bundle: dict[str, str]) -> None:
        if self.view is not None:
            if self._handle is not None:
                self._handle.update(bundle, raw=True)
            self.view.close()
            return
        if self._is_live():
            from IPython.display import display

            display(bundle, raw=True)
        else:
            print(bundle["text/plain"])

    def _fail(self, exc: Exception) -> None:
        self._done = True
        warnings.warn(f"distlab: the {self.what} failed and was left: {type(exc).__name__}: {exc}", RuntimeWarning, 3)
