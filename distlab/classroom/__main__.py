"""``python -m distlab.classroom``: a class's hub in one command, and its assignments.

    sudo .venv/bin/python -m distlab.classroom hub --learners alice,bob,carol --instructors ada \\
        --ranks 4 --labs 2 --cores 1 --memory 4G --idle 30m --notebooks notebooks
    python -m distlab.classroom assignment --course COURSE --name ps1 --exercise average-gradients

``hub`` checks what would stop the class (one line each: not root, a learner who is not a user of
this machine, a Python the learners cannot run, a limit that does not parse), writes
``<dir>/jupyterhub_config.py`` and runs JupyterHub with it in the foreground; Ctrl-C stops the hub,
every learner's server, their labs and namespaces.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "memory_bytes"]

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def memory_bytes(text: str) -> int:
    """``"4G"`` -> bytes (K, M, G, T: powers of 1024, as JupyterHub's mem_limit reads them)."""
    number, unit = text.strip().upper().rstrip("B"), ""
    if number and number[-1] in _UNITS:
        number, unit = number[:-1], number[-1]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"--memory {text!r} is not a size: give bytes or a number with K, M, G or T (4G)") from None
    if value <= 0:
        raise ValueError(f"--memory {text!r} must be more than 0")
    return int(value * _UNITS[unit])


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _hub(args: argparse.Namespace) -> int:
    from .hub import Class, problems
    from .limits import Limits

    try:
        given = {"ranks": args.ranks, "labs": args.labs, "idle": args.idle}
        # Checked here as each learner's kernel will read it.
        limits = Limits.parse(",".join(f"{key}={value}" for key, value in given.items() if value is not None))
        memory = memory_bytes(args.memory) if args.memory else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    klass = Class(
        learners=_names(args.learners), instructors=_names(args.instructors), limits=str(limits),
        cores=args.cores, memory=memory, port=args.port, state_dir=args.dir, python=args.python,
        notebooks=str(Path(args.notebooks).absolute()) if args.notebooks else None, authenticator=args.authenticator,
    )
    found = problems(klass)
    if args.notebooks and not Path(args.notebooks).is_dir():
        found.append(f"--notebooks {args.notebooks}: no such folder")
    if found:
        for line in found:
            print(f"error: {line}", file=sys.stderr)
        return 2
    state = Path(klass.state_dir)
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    config = state / "jupyterhub_config.py"
    fields: dict[str, object] = {name: getattr(klass, name) for name in klass.__dataclass_fields__}
    config.write_text(
        "# Written by python -m distlab.classroom hub; run it again to change the class.\n"
        "from distlab.classroom.hub import Class, configure\n"
        f"configure(c, Class(**{fields!r}))\n"
    )
    print(f"{len(klass.learners)} learners, {len(klass.instructors)} instructors; limits {klass.limits or 'none'}, "
          f"cores {klass.cores or 'all'}, memory {args.memory or 'all'}: http://127.0.0.1:{klass.port}/ "
          f"(config {config})", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "jupyterhub", "-f", str(config)])
    return 0  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["assignment"]:
        from .assignment import main_assignment

        return main_assignment(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m distlab.classroom", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    hub = sub.add_parser("hub", help="run a class's JupyterHub (as root)")
    hub.add_argument("--learners", required=True, help="the learners' user names on this machine, comma-separated")
    hub.add_argument("--instructors", default="", help="the instructors' user names (the hub's admins)")
    hub.add_argument("--ranks", type=int, help="the most ranks a learner may run at once, across their labs")
    hub.add_argument("--labs", type=int, help="the most labs a learner may run at once")
    hub.add_argument("--idle", help="stop a lab that ran no cell for this long (30m, 1h, 900)")
    hub.add_argument("--cores", type=float, help="cores per learner, enforced by a control group")
    hub.add_argument("--memory", help="memory per learner, enforced by a control group (4G)")
    hub.add_argument("--port", type=int, default=8000, help="the port browsers open, on 127.0.0.1")
    hub.add_argument("--dir", default="/srv/distlab-class", help="where the hub keeps its database and config")
    hub.add_argument("--python", default=sys.executable, help="the Python learners' servers run (readable by them)")
    hub.add_argument("--notebooks", help="a folder of notebooks copied into each learner's home at first start")
    hub.add_argument("--authenticator", default="pam", help="how learners log in (default pam: their password)")
    sub.add_parser("assignment", help="write an nbgrader assignment (see: assignment --help)")
    args = parser.parse_args(argv)
    return _hub(args)


if __name__ == "__main__":
    sys.exit(main())
