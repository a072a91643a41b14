"""The side panel's server side: the Jupyter server extension (``handlers``, loaded by the server
as module ``distlab.server``) and the per-lab state files it reads (``registry``, written by every
Lab and imported in kernels and scripts).

Importing this package stays light: the handlers, and the Jupyter server they need, load only when
a server loads the extension.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "distlab.server"}]


def _load_jupyter_server_extension(server_app: ServerApp) -> None:
    from .handlers import setup_handlers

    setup_handlers(server_app.web_app)
