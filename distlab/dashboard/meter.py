"""The dashboard's widgets, counting the messages they send: the budget spends what really went out.

How many messages a plotly ``FigureWidget`` sends as it is made and per ``batch_update`` depends on
plotly's and anywidget's versions and on what changed (an update that changes nothing sends none),
so the dashboard does not assume a number: each widget counts its own, at ipywidgets' ``_send``, the
one call every message after a widget's opening one goes through.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import ipywidgets as widgets

from .. import ipycompat_widgets

__all__ = ["MessageWindow", "Metered", "MeteredHTML", "MeteredLabel", "sent"]


class Metered(ipycompat_widgets.CountedSends):
    """Mixed into a widget class (before it): counts the messages the widget sends (at ipywidgets'
    private ``_send``, which ``ipycompat_widgets`` checks this ipywidgets has).

    plotly is not imported here: the progress bars (``progress_view``) count theirs too.
    """


class MeteredLabel(Metered, widgets.Label):
    """An ipywidgets Label that counts the widget messages it sends."""


class MeteredHTML(Metered, widgets.HTML):
    """An ipywidgets HTML that counts the widget messages it sends (one per change)."""


def sent(widget: Any) -> int:
    """Messages ``widget`` (a metered one) has sent so far."""
    return ipycompat_widgets.widget_messages_sent(widget)


class MessageWindow:
    """A budget of widget messages per second, spent on what the widgets really sent.

    ``charge(now, total)`` books the messages sent since the last charge (``total``: all sent so
    far) at ``now``; ``affordable(now, cost)`` says whether ``cost`` more fit in the last second.
    """

    def __init__(self, per_second: int) -> None:
        self.per_second = per_second
        self._sent: deque[tuple[float, int]] = deque()  # (time, messages) over the last second
        self._spent = 0  # of the widgets' messages, how many the window has been charged

    def affordable(self, now: float, cost: int) -> bool:
        while self._sent and self._sent[0][0] <= now - 1.0:
            self._sent.popleft()
        return sum(n for _, n in self._sent) + cost <= self.per_second

    def charge(self, now: float, total: int) -> None:
        if total > self._spent:
            self._sent.append((now, total - self._spent))
            self._spent = total
