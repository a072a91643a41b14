"""The one function the notebook sends to the ranks: it runs a rank-side function named by module.

A function sent to an engine travels by reference (module + name). Sending this one, with the
rank-side module named as text, spares the notebook importing what the ranks run (``torch``, about
2 s). ``distlab.notebook.rpc`` is the only caller, and names every rank-side function there is.
"""

from __future__ import annotations

from importlib import import_module

__all__ = ["on_rank"]


def on_rank(call: tuple[str, str, tuple[object, ...]]) -> object:
    """Run ``distlab.rank.<module>.<name>(*args)``, for ``call = (module, name, args)``, on the engine
    that receives this call. One argument, not three and the args: ipyparallel pickles each
    argument of a call on its own (on an empty cell's path, six pickles a rank became one)."""
    module, name, args = call
    return getattr(import_module(f"distlab.rank.{module}"), name)(*args)
