"""What makes ``%dist run`` on a rank behave as the fresh process torchrun would start for a script.

A rank is a long-lived process: without care, a second script whose folder has its own
``utils.py`` would get the first script's ``utils`` from ``sys.modules``, an edited helper module
would not be read again, and what a script did to torchrun's variables would outlive it. Here,
while a script runs (:func:`as_script`):

- it is ``__main__``, ``sys.argv`` is its command line, its folder is first on ``sys.path`` (as
  ``python path`` has it);
- the modules imported from its folder, and from the folder of the script run before it, are
  dropped from ``sys.modules`` first, so that its imports read their files again;
- torchrun's variables (RANK, MASTER_PORT, ...) are the lab's again afterwards, whatever it set.

The path is the notebook's (``Lab.run_script`` sends the text and the absolute path). On a rank
whose host has no such folder (another machine), nothing is put on ``sys.path``, and an import the
script's folder would have served fails naming the folder and the host.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
import types
from collections.abc import Iterable, Iterator

__all__ = ["TORCHRUN_VARIABLES", "as_script", "drop_modules_from"]

#: The variables torchrun gives each process (``rank.torchrun.set_environment`` sets them on a rank).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")

# Never dropped, wherever their files are: distlab's own modules hold the rank's state (its group,
# its hooks), and an editable install puts them in a project's folder, where a script may be too.
_KEPT = ("distlab",)

# The folder of the script run last on this rank: its modules are dropped before the next script.
_last_folder: str | None = None


@contextlib.contextmanager
def as_script(module: types.ModuleType, path: str, argv: list[str]) -> Iterator[None]:
    """Run the body as ``python path argv[1:]`` would run ``module``'s code (see the module's docstring)."""
    global _last_folder
    folder = os.path.dirname(os.path.abspath(path))
    exists = os.path.isdir(folder)
    drop_modules_from([f for f in (folder, _last_folder) if f is not None])
    importlib.invalidate_caches()  # files made since the last import in that folder are found
    _last_folder = folder
    saved_argv, saved_main = sys.argv, sys.modules.get("__main__")
    saved_env = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    sys.argv = list(argv)
    sys.modules["__main__"] = module
    if exists:
        sys.path.insert(0, folder)
    try:
        yield
    except ImportError as exc:
        if not exists and exc.name is not None and "." not in exc.name:
            # Only the first line changes: the traceback still points at the script's import.
            exc.msg = (
                f"{exc.msg} (the script's folder {folder} is not on this rank's host {socket.gethostname()}, "
                "so its own modules cannot be imported here: copy the folder to the same path on every host, "
                "or install the module)"
            )
            exc.args = (exc.msg, *exc.args[1:])
        raise
    finally:
        sys.argv = saved_argv
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        if exists:
            with contextlib.suppress(ValueError):
                sys.path.remove(folder)
        for name, value in saved_env.items():  # a process's environment ends with it
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def drop_modules_from(folders: Iterable[str]) -> list[str]:
    """Remove from ``sys.modules`` every module imported from one of ``folders``; return their names.

    A module is from a folder when its top-level package was found there: ``utils`` from
    ``folder/utils.py``, ``models.net`` from ``folder/models/``. Modules below the folder but found
    through another ``sys.path`` entry (a virtual environment inside a project) stay.
    """
    roots = {os.path.realpath(f) for f in folders}
    dropped = []
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top in _KEPT or name == "__main__":
            continue
        found_in = _found_in(sys.modules.get(top) if top != name else module)
        if found_in is not None and found_in in roots:
            del sys.modules[name]
            dropped.append(name)
    return dropped


def _found_in(module: types.ModuleType | None) -> str | None:
    """The ``sys.path`` folder a top-level module was found in, or None (built in, or not a file's)."""
    if module is None:
        return None
    file = getattr(module, "__file__", None)
    if isinstance(file, str):
        where = os.path.dirname(file)
        if os.path.basename(file).startswith("__init__."):
            where = os.path.dirname(where)  # a package: the folder holding its folder
        return os.path.realpath(where)
    paths = list(getattr(module, "__path__", None) or [])  # a namespace package: no __init__.py
    return os.path.realpath(os.path.dirname(paths[0])) if paths else None
