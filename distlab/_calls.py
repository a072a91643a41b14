"""Call an engine-side function by name, so the client never imports what the engines run.

``bootstrap`` imports torch (~2 s); the notebook kernel should not pay that to drive the ranks.
A function of this module travels by reference (module + name) and does the import on the engine.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any


def on_rank(module: str, name: str, *args: Any) -> Any:
    """Run ``distlab.<module>.<name>(*args)`` on the engine that receives this call."""
    return getattr(import_module(f"distlab.{module}"), name)(*args)
