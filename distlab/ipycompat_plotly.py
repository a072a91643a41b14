"""plotly's widget bundle, sent to the page once per kernel instead of once per figure.

plotly's ``FigureWidget`` is an anywidget whose front-end module (``_esm``) is the whole of plotly.js,
about 5 MB of text (plotly 7.1), sent in every figure's opening message. anywidget imports each
widget's module from a blob URL of its own, so a page imports and evaluates plotly.js once per
figure: the dashboard's seven figures carried 35 MB, and a page showed them 35 s after the cell
ran, on an idle 2-core machine, against 9 s for one figure (``benchmarks/bench_dashboard_page.py``).
Under load it was minutes.

Here one hidden widget (:class:`PlotlyBundle`, made once per kernel) carries the bundle as a synced
string; its small module imports it once per page and keeps the module in ``globalThis``. Each figure
(:class:`SharedBundleFigure` mixed in) carries a module of a few hundred bytes that waits for that
one and hands anywidget plotly's own widget (its default export: a factory, or an object). Nothing of
plotly's front end is changed.

What is reached into: ``BaseFigureWidget._esm``, where plotly keeps its bundle (anywidget's documented
field, but plotly's own attribute). On a plotly release outside ``KNOWN_GOOD`` the figures keep plotly's
own module: slower, never broken. Imported by the dashboard, on the notebook side.
"""

from __future__ import annotations

import re
import threading
from typing import Any

__all__ = ["KNOWN_GOOD", "SharedBundleFigure", "bundle_text", "plotly_bundle"]

#: False: every figure carries plotly's own module, as plotly makes it (the benchmark's baseline).
SHARE = True

#: plotly releases whose bundle is known to be an anywidget module for every figure alike.
KNOWN_GOOD = ((7, 1), (7, 2))

# The page's one import of the bundle: a promise in globalThis, made by whichever module runs
# first (the bundle's widget opens before any figure's, but a page restoring a kernel's widgets
# opens them all at once), resolved by the bundle's widget.
_SLOT = """
function slot() {
  const g = globalThis;
  if (!g.__distlabPlotly) {
    let resolve, reject;
    const promise = new Promise((res, rej) => { resolve = res; reject = rej; });
    g.__distlabPlotly = { promise, resolve, reject, loading: false };
  }
  return g.__distlabPlotly;
}
"""

#: The bundle widget's module: import the synced text once per page.
LOADER_ESM = _SLOT + """
export default {
  async initialize({ model }) {
    const s = slot();
    if (s.loading) return;
    s.loading = true;
    const url = URL.createObjectURL(new Blob([model.get("bundle")], { type: "text/javascript" }));
    try {
      s.resolve(await import(/* webpackIgnore: true */ /* @vite-ignore */ url));
    } catch (err) {
      s.reject(err);
    } finally {
      URL.revokeObjectURL(url);
    }
  },
};
"""

#: Each figure's module: plotly's own widget, from the page's one import.
FIGURE_ESM = _SLOT + """
export default async () => {
  const mod = await slot().promise;
  return typeof mod.default === "function" ? await mod.default() : mod.default;
};
"""

_lock = threading.Lock()
_bundle: Any = None  # the kernel's PlotlyBundle widget, once made


def _known_good() -> bool:
    import plotly

    found = re.match(r"(\d+)\.(\d+)", str(getattr(plotly, "__version__", "")))
    if found is None:
        return False
    return KNOWN_GOOD[0] <= (int(found.group(1)), int(found.group(2))) < KNOWN_GOOD[1]


def bundle_text() -> str | None:
    """plotly's widget bundle (its front-end module) as text; None where this plotly is not known good."""
    if not _known_good():
        return None
    from plotly.basewidget import BaseFigureWidget

    esm = getattr(BaseFigureWidget, "_esm", None)  # a FileContents (anywidget) over package_data/widgetbundle.js
    text = None if esm is None else str(esm)
    return text if text and "export" in text else None


def plotly_bundle() -> Any:
    """The kernel's one :class:`PlotlyBundle` widget, made (its comm opened) on first use; None where
    plotly's bundle is not shared (a release not known good, or ``SHARE`` off)."""
    global _bundle
    with _lock:
        if _bundle is not None and getattr(_bundle, "comm", None) is not None:
            return _bundle
        text = bundle_text() if SHARE else None
        if text is None:
            return None
        _bundle = _bundle_class()(bundle=text)
        return _bundle


def _bundle_class() -> type:
    import anywidget
    import traitlets

    class PlotlyBundle(anywidget.AnyWidget):
        """Never displayed: its model, made in the page as it opens, imports the bundle there."""

        _esm = LOADER_ESM
        bundle = traitlets.Unicode().tag(sync=True)

    return PlotlyBundle


class SharedBundleFigure:
    """Mixed into a plotly ``FigureWidget`` class (before it): its front end is plotly's bundle as the
    page imported it once (:func:`plotly_bundle`), not a copy of its own. Where the bundle cannot be
    shared, the figure keeps plotly's module."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The bundle's widget opens first: a figure's module waits for it in the page.
        if plotly_bundle() is not None:
            # Read by anywidget as it makes the synced ``_esm`` trait: the instance's value, then gone.
            self._esm = FIGURE_ESM
        super().__init__(*args, **kwargs)
        self.__dict__.pop("_esm", None)  # the trait is what is read from now on
