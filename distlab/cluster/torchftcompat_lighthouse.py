"""torchft's lighthouse started in a fraction of a second: ``python <this file> --bind HOST:PORT ...``.

torchft's own command, ``torchft_lighthouse``, is ``from torchft._torchft import lighthouse_main``.
Importing ``torchft._torchft`` runs ``torchft/__init__.py`` first, which imports torch and torchft's
manager: 6-9 s on this 2-core machine under load (measured: 6.7 s to "listening" beside a test
suite), for a server written in Rust that needs none of it. A lab that heals waits for it at every
start, and for a new one when it dies. Here the compiled module (``torchft._torchft``, private) is
loaded from its file alone, as a module of its own; for a torchft release other than the one healing
is run with (``KNOWN_GOOD_TORCHFT``) it is imported the usual way, slower and as good.

The compiled parser reads the process's own command line past its first word (the interpreter)
and takes the second as its name: this is run as a file (``python <file> args``), never with ``-m``.
It imports nothing of distlab: started as a file, it has no package around it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from importlib import metadata
from types import ModuleType

#: The torchft release whose compiled module is loaded alone; ``rank/torchcompat_torchft.py`` names
#: the same (a test checks that the two agree).
KNOWN_GOOD_TORCHFT = "0.2.0"


def _compiled_module() -> ModuleType:
    if metadata.version("torchft") != KNOWN_GOOD_TORCHFT:
        # The release's own way, for a release not checked here.
        return importlib.import_module("torchft._torchft")
    spec = importlib.util.find_spec("torchft")  # finds the package without running its __init__
    assert spec is not None and spec.submodule_search_locations
    folder = spec.submodule_search_locations[0]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_torchft" + suffix)
        if os.path.exists(path):
            loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", path)
            found = importlib.util.spec_from_file_location("torchft._torchft", path, loader=loader)
            assert found is not None
            module = importlib.util.module_from_spec(found)
            loader.exec_module(module)
            return module
    raise SystemExit(
        f"torchft's compiled module (_torchft) is not in {folder}: pip install torchft=={KNOWN_GOOD_TORCHFT}"
    )


if __name__ == "__main__":
    sys.exit(_compiled_module().lighthouse_main())
