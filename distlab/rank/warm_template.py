"""The template process warm ranks are forked from (``cluster.warm`` starts and talks to it).

    python -m distlab.rank.warm_template PARENT_PID

It imports what a rank imports (torch, torch.distributed, ipyparallel's engine, distlab's rank
side) once, then forks an engine per request: the engine starts with all of that already in
memory, so it registers in a fraction of a cold start (benchmarks/RESULTS.md). Nothing here opens
a socket, starts a Python thread or touches CUDA before a fork (a forked child would inherit a
socket and lose a thread). Importing torch starts one native thread that sleeps; forking after
that import is what torch's own DataLoader workers do on Linux.

Requests come on stdin, one JSON line each: ``{"argv": [...], "env": {...}, "cwd": ..., "log": ...}``
(and ``"node": {"netns": ..., "hostname": ...}`` for an engine on an emulated node, which joins it);
the answer on stdout is ``{"pid": N}`` (or ``{"error": "..."}``). ``{"entry": "preload", "modules":
[...]}`` imports more here first, for the processes forked after it (a healing lab's torchft).
The template ends when its stdin closes: when the process that started it stops it or ends, however
it ends; while it imports (seconds on a loaded machine, and stdin is read only after) a timer
checks every 0.2 s that the process that started it is still its parent.
A forked engine is a session of its own, as ipyparallel starts engines: the lab that asked
for it signals, guards and reaps it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

# The titles fit in the template's own command line (the only space rewritten): the interpreter's
# name, not its path.
_PYTHON = os.path.basename(sys.executable)
# ``python -m`` put the directory the template started in first on sys.path; an engine started cold
# has the directory it starts in there (where a notebook's own modules are imported from).
_STARTED_IN = os.getcwd()


_ORPHAN_CHECK_S = 0.2
# unshare(2)'s flag for a hostname of one's own (<sched.h>); os.unshare is Python 3.12's.
_CLONE_NEWUTS = 0x04000000


class _EndsWithParent:
    """While the template imports, it ends as soon as the process that started it has (seen as a
    new parent: the template is reparented). A timer's signal, not a thread: nothing here starts a
    thread before a fork, and a fork does not inherit the timer (the handler is reset in the child)."""

    def __init__(self) -> None:
        # Said on the command line by the process that started it: it may have ended before now.
        self.parent = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()

    def _check(self, signum: int = 0, frame: object = None) -> None:
        if os.getppid() != self.parent:
            os._exit(0)

    def __enter__(self) -> None:
        self._check()
        signal.signal(signal.SIGALRM, self._check)
        signal.setitimer(signal.ITIMER_REAL, _ORPHAN_CHECK_S, _ORPHAN_CHECK_S)

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _preload() -> None:
    # A forked process's command line is the template's until it says otherwise: ``ps``, the
    # tests and the user see "distlab.rank.engine_main" as for an engine started cold. Only the
    # template's own argv space is rewritten (SPT_NOENV): /proc/PID/environ stays readable.
    os.environ["SPT_NOENV"] = "1"
    import ipyparallel.controller.app
    import ipyparallel.engine.app
    import ipyparallel.engine.nanny  # noqa: F401
    import setproctitle  # noqa: F401

    import distlab.rank.engine_main
    import distlab.rank.group
    import distlab.rank.namespace  # noqa: F401
    from distlab.rank.torchcompat_compile import load_dynamo

    # TorchDynamo: torch imports it at a process's first optimizer or DDP model, 1.2-1.5 s of CPU
    # for each rank of every lab here (4 ranks on 2 cores: seconds of a first training cell). Once,
    # here, it is in every rank forked after; it starts no thread (a fork keeps it whole).
    load_dynamo()


def _preload_more(request: dict[str, object]) -> dict[str, object]:
    """Import more modules here, for the processes forked from now on (a healing lab's torchft):
    ``{"modules": [...], "env": {...}}``, the variables set only where not set (read by what is
    imported)."""
    import importlib

    env = request.get("env") or {}
    modules = request.get("modules") or []
    assert isinstance(env, dict) and isinstance(modules, list)
    for name, value in env.items():
        os.environ.setdefault(str(name), str(value))
    try:
        for module in modules:
            importlib.import_module(str(module))
    except Exception as exc:  # noqa: BLE001 - the lab goes on: its ranks import it themselves
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"loaded": len(modules)}


def _child(request: dict[str, object]) -> None:
    """In the forked child: become the engine the request describes; never returns."""
    code = 1
    try:
        os.setsid()  # a session and process group of its own, as ipyparallel's launcher makes
        node = request.get("node")
        if node:
            assert isinstance(node, dict)
            _enter_node(str(node["netns"]), str(node["hostname"]))
        _as_a_fresh_python()
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.chdir(str(request["cwd"]))
        if sys.path and sys.path[0] == _STARTED_IN:
            sys.path[0] = os.getcwd()
        from setproctitle import setproctitle

        # Before the environment is replaced: setproctitle finds the argv space by where the
        # original environment lies.
        entry = "ipyparallel.controller" if request.get("entry") == "controller" else "distlab.rank.engine_main"
        setproctitle(f"{_PYTHON} -m {entry}")
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        argv = request["argv"]
        assert isinstance(argv, list)
        # ipyparallel's apps chdir to their work_dir, whose default was read when the template
        # imported them: the request's directory is said explicitly.
        argv = [*argv, f"--BaseParallelApplication.work_dir={os.getcwd()}"]
        if request.get("entry") == "controller":
            sys.argv = ["ipcontroller", *map(str, argv)]
            from ipyparallel.controller.app import main as controller_main

            controller_main()
            code = 0
        else:
            sys.argv = ["ipengine", *map(str, argv)]
            _forked_nanny()
            from distlab.rank import engine_main

            engine_main.main()  # exits the process itself
    except BaseException:  # noqa: BLE001 - the engine's log says why it did not start
        traceback.print_exc()
    finally:
        os._exit(code)


def _enter_node(netns: str, hostname: str) -> None:
    """Join an emulated node (``cluster.nodes``): its network namespace (``netns``, a path under
    /run/netns) and a hostname of its own, as ``ip netns exec NS unshare --uts`` and ``hostname``
    do for an engine started cold. Before any socket: the engine's are all made in the node."""
    import ctypes
    import socket

    from distlab.host import enter_network_namespace

    enter_network_namespace(netns, f"the node's network namespace {netns}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "a hostname of the node's own (unshare CLONE_NEWUTS)")
    socket.sethostname(hostname)


def _as_a_fresh_python() -> None:
    """Undo what the template changed, and what a fork shares that a new process would not have.

    Signals: a fresh Python raises KeyboardInterrupt on SIGINT (how a cell is interrupted) and
    leaves SIGCHLD alone. Random state: Python's ``random`` reseeds itself in a forked child, numpy's
    global generator does not (torch's DataLoader workers reseed it for the same reason): without
    this every rank, and every restart, would draw the same numbers.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _forked_nanny() -> None:
    """The engine's nanny (it tells the controller at once when the engine dies) forked now, not
    started as a fresh Python that imports ipyparallel again (~1 s of the engine's registration).

    ipyparallel's ``start_nanny`` pickles its arguments to a new process's stdin and reads the
    nanny's address from its stdout; here the nanny is forked before the engine has a zmq context
    (a context does not survive a fork) and waits on pipes for the same two messages.
    """
    import pickle

    import ipyparallel.engine.app as app
    from ipyparallel.engine.nanny import KernelNanny
    from setproctitle import setproctitle

    to_nanny_r, to_nanny_w = os.pipe()
    from_nanny_r, from_nanny_w = os.pipe()
    if os.fork() == 0:  # the nanny
        code = 0
        try:
            os.setsid()  # its own session, as ipyparallel starts it: a signal to the engine is not its
            setproctitle(f"{_PYTHON} -m ipyparallel.engine.nanny")
            os.close(to_nanny_w)
            os.close(from_nanny_r)
            with os.fdopen(to_nanny_r, "rb") as f:
                try:
                    kwargs = pickle.load(f)
                except EOFError:  # the engine ended before it asked for a nanny
                    os._exit(0)
            kwargs["pipe"] = os.fdopen(from_nanny_w, "w", buffering=1)
            KernelNanny.main(**kwargs)
        except BaseException:  # noqa: BLE001 - in the engine's log
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(to_nanny_r)
    os.close(from_nanny_w)

    def start_nanny(**kwargs: object) -> tuple[str, object]:
        kwargs["pid"] = os.getpid()
        with os.fdopen(to_nanny_w, "wb") as f:
            pickle.dump(kwargs, f)
        reply = os.fdopen(from_nanny_r, "r")
        url = reply.readline().strip()
        if not url:
            raise RuntimeError("nanny failed")
        # Kept open for the engine's life: the nanny takes its closing as the engine's end.
        return url, reply

    app.start_nanny = start_nanny


def _say(answer: dict[str, object]) -> None:
    try:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # whoever asked has ended: so does the template, quietly
        os._exit(0)


def main() -> None:
    with _EndsWithParent():
        _preload()
    # Forked engines are reaped by their labs; the template never waits for them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is for the notebook
    _say({"ready": os.getpid()})
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError as exc:
            _say({"error": f"bad request: {exc}"})
            continue
        if request.get("entry") == "preload":
            with _EndsWithParent():
                answer = _preload_more(request)
            _say(answer)
            continue
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:  # out of memory or of processes: the lab says so, the template goes on
            _say({"error": f"fork failed: {exc}"})
            continue
        if pid == 0:
            _child(request)
        _say({"pid": pid})


if __name__ == "__main__":
    main()
