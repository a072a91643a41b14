"""The Jupyter server side of the side panel: ``GET /distlab/labs``, the labs in this server's kernels.

Each lab writes its own state file (``distlab._registry``); this handler reads them, keeps those
whose kernel belongs to this server, and names the kernel's notebook from the session manager.
Enabled by ``jupyter-config/server-config/distlab.json``, installed with the package.
"""

from __future__ import annotations

import json
import os
from typing import Any

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from ._registry import read_labs

__all__ = ["LabsHandler", "labs_in_server"]


async def labs_in_server(kernel_manager: Any, session_manager: Any) -> list[dict[str, Any]]:
    """The running labs whose kernel this server manages, each with ``kernel_id``, ``kernel_name``
    and ``notebook`` (the session's path, or None for a kernel with no session), oldest first."""
    kernels = {}
    for kernel_id in kernel_manager.list_kernel_ids():
        connection_file = getattr(kernel_manager.get_kernel(kernel_id), "connection_file", "")
        if connection_file:
            kernels[os.path.realpath(connection_file)] = kernel_id
    sessions = {s["kernel"]["id"]: s for s in await session_manager.list_sessions() if s.get("kernel")}
    labs = []
    for lab in read_labs():
        kernel_id = kernels.get(lab.get("connection_file") or "")
        if kernel_id is None:
            continue  # a lab in a script, or in another server's kernel
        session = sessions.get(kernel_id, {})
        lab.update(
            kernel_id=kernel_id,
            kernel_name=kernel_manager.get_kernel(kernel_id).kernel_name,
            notebook=session.get("path"),
        )
        labs.append(lab)
    return labs


class LabsHandler(APIHandler):
    """``GET /distlab/labs`` -> ``{"labs": [...]}``; for logged-in users allowed to see kernels."""

    auth_resource = "kernels"

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        labs = await labs_in_server(self.kernel_manager, self.session_manager)
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps({"labs": labs}))


def _load_jupyter_server_extension(server_app: Any) -> None:
    web_app = server_app.web_app
    route = url_path_join(web_app.settings["base_url"], "distlab", "labs")
    web_app.add_handlers(".*$", [(route, LabsHandler)])


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "distlab._server"}]
