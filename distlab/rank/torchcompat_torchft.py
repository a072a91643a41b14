"""The private torchft API behind healing labs (``rank/heal.py``): its DDP's gradient hook.

``rank/torchcompat.py``'s rule holds here: each private API is used in this module and nowhere else,
with what it does and why no public API does it. torchft is checked too: each function here refuses,
in one line, a torchft other than the release healing is run with (``KNOWN_GOOD_TORCHFT``, which
``pyproject.toml``'s ``heal`` extra pins). Importing it imports ``torchcompat_release`` first, so the torch
release is checked as well; torchft itself is imported only when a function needs it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import metadata
from typing import Any, cast

import torch
import torch.distributed as dist

from ..errors import DistlabError
from . import torchcompat_release  # noqa: F401 - checks the torch release before anything here is used

__all__ = ["KNOWN_GOOD_TORCHFT", "healing_ddp_class", "torchft_version_problem"]

#: The torchft release healing labs are run with.
KNOWN_GOOD_TORCHFT = "0.2.0"


def torchft_version_problem(version: str) -> str | None:
    """None for the torchft release in ``KNOWN_GOOD_TORCHFT``, else the one line that says what to do."""
    if version == KNOWN_GOOD_TORCHFT:
        return None
    return (f"distlab's healing is known to work with torchft {KNOWN_GOOD_TORCHFT}, and this is torchft {version}: "
            f"install it (pip install torchft=={KNOWN_GOOD_TORCHFT}); a newer release must first be checked "
            "against distlab/rank/torchcompat_torchft.py")


def _check_torchft() -> None:
    problem = torchft_version_problem(metadata.version("torchft"))
    if problem is not None:
        raise DistlabError(problem)


@functools.cache
def healing_ddp_class(lost_quorum: Callable[[BaseException], None]) -> Any:
    """torchft's ``DistributedDataParallel``, with its gradient hook made safe for a peer that dies
    mid-exchange and for a quorum that failed: ``healing_ddp_class(lost_quorum)(manager, model)``.

    ``DistributedDataParallel._comm_hook`` (the hook torchft's DDP registers, a static method) and
    its future's ``_fut`` (the torch future inside torchft's managed one): torchft 0.2.0's hook
    asserts on the future its manager hands back once it has errored (a plain completed one; upstream
    issues #295 and #304), and the survivor crashed instead of skipping the step. Here the gradient
    comes back as it is; the step does not commit (``should_commit`` says no), so nothing of it
    reaches the weights. torchft has no public way to give its DDP another hook.

    ``Manager._quorum_future``: a quorum that failed (its lighthouse died while the manager waited)
    raises out of ``allreduce`` in the middle of backward, which leaves DDP's reducer half done, and
    again from the next step's ``start_quorum``, which waits on the previous quorum first. Here the
    failure is reported as any error of the step is (the step does not commit) and the manager
    forgets that quorum, so the next step asks for a new one; ``lost_quorum`` is told. torchft has no
    public way to drop a failed quorum.
    """
    _check_torchft()
    from torchft.ddp import DistributedDataParallel

    class HealingDDP(DistributedDataParallel):
        """torchft's DDP, with its gradient hook made safe for a peer that dies mid-exchange."""

        @staticmethod
        def _comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            try:
                work = state.allreduce(bucket.buffer())
            except Exception as exc:  # noqa: BLE001 - the quorum's failure: torchft reports its exchange's own errors
                state.report_error(exc)
                state._quorum_future = None
                lost_quorum(exc)
                lost: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                lost.set_result(bucket.buffer())
                return lost
            work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if inner is not None:
                # torchft's inner future (untyped) carries the gradient bucket's tensor
                return cast("torch.futures.Future[torch.Tensor]", inner)
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    # DDP checks a hook's annotations as objects; this module's are strings (``from __future__``).
    HealingDDP._comm_hook.__annotations__ = {
        "state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]
    }
    return HealingDDP
