"""Engine entry point for engines on this machine: import torch while the engine registers, and
exit without the interpreter's teardown.

An engine spends ~1 s starting ipyparallel and registering, then ~1.5 s importing torch. Here
the import runs in a thread from the first instant, so the two overlap (see benchmarks/RESULTS.md).

    python -m distlab.rank.engine_main [ipengine arguments]
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
import time
import traceback

# How long an exiting engine waits for threads a cell left running (a normal exit would wait for
# them without a bound; distlab kills what is left after its own grace period anyway).
_THREAD_JOIN_S = 2.0


def _preload() -> None:
    import distlab.rank.group  # noqa: F401  (imports torch and torch.distributed)


def main() -> None:
    threading.Thread(target=_preload, name="distlab-preload", daemon=True).start()
    from ipyparallel.engine.app import main as engine_main

    from distlab import ipycompat_engine

    ipycompat_engine.patient_connection_file()  # this engine may start before the controller has written it

    try:
        # A stop (SIGTERM) ends the engine's loop under it, and this raises RuntimeError ("Event loop
        # stopped before Future completed"): the traceback and exit status are what they always were.
        engine_main()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - reported as Python reports an uncaught exception
        traceback.print_exc()
        code = 1
    else:
        code = 0
    _exit(code)


def _exit(code: object) -> None:
    """Exit as Python would, minus tearing down its modules.

    With torch loaded, the interpreter's teardown of its modules takes 0.5-0.6 s on this project's
    2-core machine, every time a rank stops (measured: exit 0.48-0.64 s after the last line of a
    script that imported torch; 0.02-0.03 s with the exit handlers run and then ``os._exit``). What
    a rank's exit does for the user is kept, in Python's order: threads left running are joined
    (bounded), every ``atexit`` handler runs (logging's, torch's, the user's), the cells' namespace
    is released (objects freed as at exit: an open file is flushed and closed), output is flushed.
    """
    # Python's own order: threads left running are joined, the exit handlers run, then objects go.
    deadline = time.monotonic() + _THREAD_JOIN_S
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    atexit._run_exitfuncs()  # what Python's own exit runs before its teardown
    with contextlib.suppress(Exception):  # teardown, best effort: the exit code is decided
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            shell.user_ns.clear()  # the cells' objects are freed: an open file is flushed and closed
        gc.collect()
    if isinstance(code, str):
        print(code, file=sys.stderr)  # as Python prints a SystemExit's message
        code = 1
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is None:  # a process started without that stream
            continue
        with contextlib.suppress(Exception):  # a closed or broken stream: the rank still exits
            stream.flush()
    os._exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
