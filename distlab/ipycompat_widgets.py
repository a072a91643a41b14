"""The private ipywidgets API distlab uses: a widget's ``_send``, to count the messages it sends.

``ipycompat.py``'s rule holds here: each private API is used in this module and nowhere else, its
release checked (``ipycompat.KNOWN_GOOD``) and a missing attribute refused in one line. Imported by
the notebook's dashboard; it imports ipywidgets only when a counted widget class is made.
"""

from __future__ import annotations

from .ipycompat import checked_package, required_attribute

__all__ = ["CountedSends", "widget_messages_sent"]


class CountedSends:
    """Mixed into an ipywidgets widget class (before it): counts the messages the widget sends.

    ``Widget._send``: the one call every message after a widget's opening one goes through; no
    public hook sees them. A class that mixes this in checks, as it is made, that ipywidgets still
    has it: otherwise nothing would be counted, silently.
    """

    #: Messages this widget has sent to the front end since its comm opened (the opening one not counted).
    _messages_sent = 0

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        widgets = checked_package("ipywidgets")
        required_attribute(widgets.Widget, "_send", "ipywidgets", "count the messages a widget sends")

    def _send(self, msg: object, buffers: object = None) -> None:  # passed on as ipywidgets gave them
        # ipywidgets' own test: nothing goes out before the comm opens, nor on a comm without a kernel.
        comm = getattr(self, "comm", None)
        if comm is not None and getattr(comm, "kernel", True) is not None:
            self._messages_sent += 1
        super()._send(msg, buffers)  # type: ignore[misc]  # a mixin: super() is the widget class after it


def widget_messages_sent(widget: CountedSends) -> int:
    """Messages ``widget`` (a :class:`CountedSends` one) has sent so far."""
    return int(widget._messages_sent)
