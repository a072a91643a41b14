"""The private ipyparallel and ipykernel APIs a rank uses in its own process: the engine reading its
controller's connection file, telling an engine from other processes, answering a control message.

``ipycompat.py``'s rule holds here: each private API is used in this module and nowhere else, its
release checked (``ipycompat.KNOWN_GOOD``) and a missing attribute refused in one line. Imported on
the ranks; it imports ipyparallel and ipykernel only when a function needs them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from .errors import DistlabError
from .ipycompat import checked_package, required_attribute

__all__ = ["on_engine", "patient_connection_file", "serve_control_request"]


def patient_connection_file(deadline_s: float = 10.0) -> None:
    """Make this engine process read its controller's connection file once it is whole.

    ``IPEngine.load_connection_file`` (no documented API) reads the file once the engine has seen it
    exist; the controller writes it in place (``open(path, "w")`` then its JSON), so an engine that
    looks in between reads an empty file and dies of a JSONDecodeError. Engines start before the
    controller is up (their start overlaps its own), and on a loaded machine one did exactly that:
    a lab start then waited its whole timeout for an engine that had died. The write is one
    ``write`` of a few hundred bytes, so the file is empty or whole: read again until it parses.
    """
    checked_package("ipyparallel")
    from ipyparallel.engine.app import IPEngine

    load = required_attribute(IPEngine, "load_connection_file", "ipyparallel", "read the controller's connection file")
    if getattr(load, "_distlab_patient", False):
        return

    def patient_load(self: object) -> object:
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                return load(self)
            except ValueError:  # json's JSONDecodeError: the controller has not written it yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    vars(patient_load)["_distlab_patient"] = True  # a function's attribute, through its __dict__ (mypy types that)
    IPEngine.load_connection_file = patient_load


def on_engine() -> bool:
    """True when this process is an ipyparallel engine; never imports ipyparallel to find out.

    ``ipyparallel.engine.kernel.IPythonParallelKernel``: the engine's kernel class, in a module that
    is no documented API. Every engine has imported it before it runs anything of distlab's.
    """
    module = sys.modules.get("ipyparallel.engine.kernel")
    if module is None:
        return False
    checked_package("ipyparallel")
    what = "tell an engine from other processes"
    kernel_class = required_attribute(module, "IPythonParallelKernel", "ipyparallel", what)
    from IPython import get_ipython

    return isinstance(getattr(get_ipython(), "kernel", None), kernel_class)


def serve_control_request(
    msg_type: str, reply_type: str, answer: Callable[[dict[str, object]], dict[str, object]]
) -> bool:
    """Answer ``msg_type`` on this kernel's control channel with ``reply_type`` and the content
    ``answer(request's content)`` gives, from the kernel's control thread; False outside a kernel.

    ``Kernel.control_handlers``: the table ipykernel dispatches control messages on,
    ``{msg_type: handler(stream, idents, parent)}``; it has no public way to add a message type. The
    reply goes out through the kernel's session (jupyter_client's public ``Session.send``).
    """
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:
        return False
    checked_package("ipykernel")
    handlers = required_attribute(kernel, "control_handlers", "ipykernel", "answer a control request")
    session = required_attribute(kernel, "session", "ipykernel", "answer a control request")
    if not isinstance(handlers, dict):
        raise DistlabError(f"ipykernel {checked_package('ipykernel').__version__}'s control_handlers is no dict: "
                           "install ipykernel 7.4.x or report it (see distlab/ipycompat.py)")

    def handle(stream: object, ident: object, parent: object) -> None:  # passed through to the session
        content = parent.get("content") if isinstance(parent, dict) else None
        session.send(stream, reply_type, answer(content if isinstance(content, dict) else {}), parent, ident=ident)

    handlers[msg_type] = handle
    return True
