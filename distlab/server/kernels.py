"""Evaluating one Python expression in a kernel of this Jupyter server, from the server's event loop.

The expression travels as a ``user_expression`` of a silent, empty ``execute_request`` on a client
of the kernel's own manager, and its value comes back in the ``execute_reply``: nothing depends on
an IOPub subscription having caught up (a fresh one misses what the kernel publishes before it
connects), and nothing shows in the notebook (no output, no execution count, no history).

The request queues behind a running cell like any other: ``evaluate`` waits for it, up to a
deadline, without blocking the server (every wait is on ``zmq.asyncio``).
"""

from __future__ import annotations

import ast
import time
from queue import Empty
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from jupyter_client.manager import AsyncKernelManager

__all__ = ["KernelDied", "evaluate"]

# While waiting for the reply, the kernel is checked for life this often (s).
_ALIVE_EVERY_S = 1.0


class Outcome(TypedDict, total=False):
    """What :func:`evaluate` answers: ``status`` "ok" (``value``), "error" (``ename``, ``evalue``) or "aborted"."""

    status: str
    value: object
    ename: str
    evalue: str


class _ExpressionResult(TypedDict, total=False):
    """A user expression's result in an ``execute_reply`` (the messaging protocol's), or the reply's error."""

    status: str
    data: dict[str, str]  # by MIME type
    ename: str
    evalue: str


class _ReplyContent(_ExpressionResult, total=False):
    """An ``execute_reply``'s content."""

    user_expressions: dict[str, _ExpressionResult]


class KernelDied(RuntimeError):
    """The kernel ended before it answered."""


async def evaluate(kernel: AsyncKernelManager, expression: str, timeout: float) -> Outcome:
    """Evaluate ``expression`` in a kernel (``kernel``: its manager, ``kernel_manager.get_kernel(id)``); answer
    ``{"status": "ok", "value": <the value, for a str the str itself>}``, or
    ``{"status": "error", "ename": ..., "evalue": ...}`` when it raised, or ``{"status": "aborted"}``
    when the kernel dropped the request (a cell queued before it failed).

    Raises TimeoutError after ``timeout`` seconds without a reply (the request stays queued in the
    kernel and still runs when the kernel gets to it) and KernelDied if the kernel ends first."""
    deadline = time.monotonic() + timeout
    client = kernel.client()
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    try:
        msg_id = client.execute(
            "", silent=True, store_history=False, user_expressions={"value": expression},
            allow_stdin=False, stop_on_error=False,
        )
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from the kernel within {timeout:g} s")
            try:
                reply = await client.get_shell_msg(timeout=min(left, _ALIVE_EVERY_S))
            except Empty:
                if not await kernel.is_alive():
                    raise KernelDied("the kernel ended before it answered") from None
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                return _outcome(reply["content"])
    finally:
        client.stop_channels()


def _outcome(content: _ReplyContent) -> Outcome:
    if content.get("status") == "aborted":
        return {"status": "aborted"}
    # The code is empty, so an error here is the kernel's own (a pre-run hook), not the expression's.
    result: _ExpressionResult = (
        content if content.get("status") != "ok" else content.get("user_expressions", {}).get("value", {})
    )
    if result.get("status") != "ok":
        return {"status": "error", "ename": result.get("ename", ""), "evalue": result.get("evalue", "")}
    text = result.get("data", {}).get("text/plain", "")
    value: object
    try:
        value = ast.literal_eval(text)  # a str comes back as its repr
    except (ValueError, SyntaxError):
        value = text
    return {"status": "ok", "value": value}
