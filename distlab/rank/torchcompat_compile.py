"""The private torch APIs behind ``torch.compile``'s wrappers, as the watch and the models meet them:
the module a compiled one wraps, functions torch.compile must call as they are, and whether code runs
inside a compiled call.

The rest of ``rank/torchcompat.py``'s rule holds here: each private API is called in this module
and nowhere else, with what it does and why no public API does it. Importing it imports
``torchcompat_release`` first, so the torch release is checked before any of these are touched.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import TypeVar, cast

import torch

from . import torchcompat_release  # noqa: F401 - checks the torch release before anything here is used

__all__ = ["compiled_original", "inside_compiled_call", "load_dynamo", "not_compiled"]

_F = TypeVar("_F", bound=Callable[..., object])


def not_compiled(fn: _F) -> _F:
    """``torch.compiler.disable(fn)``, typed: torch.compile calls ``fn`` as it is, never traces into it.

    It imports TorchDynamo (1.2-1.5 s), which torch imports anyway at the first optimizer a process makes
    (``Optimizer.add_param_group`` is wrapped the same way)."""
    disable: Callable[[_F], object] = torch.compiler.disable  # torch's is unannotated
    return cast(_F, disable(fn))  # torch's wrapper calls fn with the arguments it is given


def load_dynamo() -> None:
    """Import TorchDynamo (``torch._dynamo``) now, as torch does at a process's first optimizer or DDP
    model: the warm template does, once, for every rank it forks. torch has no public call that only
    loads it (``torch.compiler``'s functions import it as a side effect)."""
    import torch._dynamo  # noqa: F401


_COMPILED_CALL_FILE = os.path.join("torch", "_dynamo", "eval_frame.py")


def inside_compiled_call() -> bool:
    """True when the caller runs inside a call of a ``torch.compile``'d module or function.

    Found on the Python stack: the wrapper ``torch/_dynamo/eval_frame.py`` puts around a compiled
    call holds the context that compiles it as ``self``. Not ``torch.compiler.disable``'s wrapper,
    which lives there too, and not a compiled module's own hooks, which run before its compiled call.
    torch offers no public query (``torch.compiler.is_compiling`` is true only while tracing).
    """
    frames = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled (and no import here)
    compiling = getattr(frames, "_TorchDynamoContext", None)
    disabling = getattr(frames, "DisableContext", ())
    if compiling is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_COMPILED_CALL_FILE):
            context = frame.f_locals.get("self")
            if isinstance(context, compiling) and not isinstance(context, disabling):
                return True
        frame = frame.f_back
    return False


def compiled_original(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped, or None when ``model`` is not a compiled module.

    ``OptimizedModule._orig_mod``: torch.compile returns a wrapper whose parameters and state-dict
    keys are prefixed ``_orig_mod.``; torch offers no public accessor for the module inside.
    """
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None
