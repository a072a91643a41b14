"""What each ``%dist`` subcommand takes: its argparse parser, and the argument types they share.

The values are only read here; ``LabConfig`` and ``checks`` say what is wrong with one, for the magics
and the API alike.
"""

from __future__ import annotations

import argparse
from typing import Any

from IPython.core.magic_arguments import MagicArgumentParser

from .. import checks
from ..errors import LabUsageError

__all__ = [
    "checked", "debug_parser", "export_parser", "kill_parser", "link_parser", "no_args_parser", "ranks_phrase",
    "restart_parser", "run_parser", "seconds", "stacks_parser", "start_parser",
]


def _text(text: str) -> Any:
    """A number if the text reads as one, else the text: the checks that follow say what is wrong
    with it in one place (``LabConfig``, ``checks``), for the magics and the API alike."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def checked(check: Any) -> Any:
    """An argparse type from a ``checks`` function: its message becomes argparse's."""

    def convert(text: str) -> Any:
        try:
            return check(_text(text))
        except LabUsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def ranks_phrase(n: int, adjective: str = "") -> str:
    return f"{n} {adjective}rank{'s' if n != 1 else ''}"


seconds = checked(lambda v: checks.positive("--timeout", v, example="--timeout 30", kind="a number of seconds"))


def start_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist start", add_help=False)
    p.add_argument("-n", "--ranks", type=_text, default=2, help="number of ranks")
    p.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    p.add_argument("--timeout", type=_text, default=30.0, help="seconds any wait may take")
    p.add_argument("--launcher", default="local", help="ipyparallel engine launcher: local, mpi, ssh, slurm, ...")
    p.add_argument("--debug", action="store_true", help="torch's collective checking (TORCH_DISTRIBUTED_DEBUG=DETAIL)")
    p.add_argument(
        "--heal", action="store_true", help="per-step quorum on torchft: a rank's death does not stop the others"
    )
    p.add_argument(
        "--spares", type=_text, default=None,
        help="engines kept ready beside the ranks, for a restart or a replacement (default: one per rank)",
    )
    p.add_argument(
        "--nodes", type=_text, default=None, help="emulated nodes (network namespaces) to spread the ranks over"
    )
    p.add_argument("--link", default=None, help="each node's link, both ways, like 1gbit or 100mbit")
    p.add_argument("--latency", default=None, help="one-way delay between nodes, like 200us (needs netem)")
    p.add_argument("--subnet", default=None, help="the nodes' IPv4 subnet (default: a free /24 of 198.18.0.0/15)")
    p.add_argument("--racks", type=_text, default=None, help="racks the nodes are in, each with one uplink to a spine")
    p.add_argument("--uplink", default=None, help="each rack's uplink to the spine, both ways, like 1gbit")
    p.add_argument("--keep", nargs="?", const=True, default=False, type=_text,
                   help="outlive this kernel, for %%dist attach in another (seconds to wait for one; default 3600)")
    return p


def link_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist link", add_help=False)
    p.add_argument("rate", nargs="?", default=None, help="the new rate, like 100mbit; off: not shaped")
    p.add_argument("--latency", default=None, help="one-way delay between nodes, like 1ms (needs netem)")
    p.add_argument("--uplink", default=None, help="each rack's uplink to the spine, like 1gbit; off: not shaped")
    return p


def restart_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist restart", add_help=False)
    p.add_argument("-n", "--ranks", type=_text, default=None, help="a new world size")
    return p


def kill_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist kill", add_help=False)
    p.add_argument("rank", type=checked(lambda v: checks.whole("the rank", v, example="%dist kill 1")))
    return p


def run_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist run", add_help=False)
    p.add_argument("--timeout", type=seconds, default=None, help="seconds the script may run")
    p.add_argument("file", help="the script, as torchrun is given it")
    # Everything after the file is the script's, options too (--epochs 2), as torchrun passes them.
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments: sys.argv[1:] on every rank")
    return p


def debug_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist debug", add_help=False)
    p.add_argument(
        "rank", nargs="?", default=None, help="the rank to look into (default: the first that failed in the last cell)",
        type=checked(lambda v: checks.whole("the rank", v, example="%dist debug 1")),
    )
    return p


def stacks_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist stacks", add_help=False)
    p.add_argument("ranks", nargs="?", default=None, help="the ranks, like 0,2-3 (default: all)")
    p.add_argument("--native", action="store_true", help="with the C and C++ frames (torch's, gloo's)")
    p.add_argument("--all", action="store_true", help="every thread, not only the one that runs cells")
    return p


def export_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist export", add_help=False)
    p.add_argument("file", help="the script to write, like train.py")
    return p


def no_args_parser(sub: str) -> MagicArgumentParser:
    return MagicArgumentParser(prog=f"%dist {sub}", add_help=False)
