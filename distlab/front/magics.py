"""The IPython layer: parse a magic's arguments, call the Lab, show the result. Nothing else.

    %dist start -n 2 [--backend auto|gloo|nccl] [--timeout S] [--launcher local|mpi|ssh|slurm|...] [--debug] [--heal]
                     [--spares K] [--keep [S]]
                     [--nodes K [--link RATE [--latency T]] [--subnet NET] [--racks R [--uplink RATE]]]
    %dist status | restart [-n N] | kill RANK | stop | link [RATE [--latency T] | off] [--uplink RATE | off]
    %dist run [--timeout S] FILE.py [ARGS...] | export FILE.py
    %dist debug [RANK] | stacks [RANKS] | profile [--steps N] [--warmup W] [--path FILE]
    %dist attach [LAB_ID]
    %dist auto on|off
    %%ddp [-r RANKS] [--timeout S] [--strict]
    %%local
    %quiz TOPIC [-n N] [--difficulty LEVEL]
    %exercise [NAME | check NAME [--seed N] | hint NAME]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from dataclasses import replace
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .. import checks
from ..errors import LabUsageError
from ..notebook import labs
from ..notebook.auto_cells import AutoCells
from ..notebook.config import LabConfig
from ..notebook.dist_args import (
    debug_parser,
    export_parser,
    kill_parser,
    link_parser,
    no_args_parser,
    ranks_phrase,
    restart_parser,
    run_parser,
    seconds,
    stacks_parser,
    start_parser,
)
from .learning_magics import LearningMagics
from .pause_magics import break_magic, show_pause, show_values, step_magic
from .profiling import profile_parser, show_after

__all__ = ["DistMagics", "auto", "current_lab", "register", "unregister"]

_SUBCOMMANDS = (
    "start", "status", "restart", "kill", "stop", "link", "run", "export", "debug", "stacks", "profile", "attach",
    "auto", "break", "step", "continue",
)


@magics_class
class DistMagics(Magics):
    """%dist and %%ddp. The lab they drive is ``self.lab`` (one per IPython session); %quiz and
    %exercise (``learning_magics``) are given it."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.lab: Any = None
        self._armed: Any = None  # the Profile %dist profile armed
        #: Auto mode's input transformer (``%dist auto on``): register() puts it first in IPython's list.
        self.auto = AutoCells(lambda: self.lab is not None and self.lab.running)

    # ------------------------------------------------------------------------ %dist

    @line_magic
    def dist(self, line: str) -> Any:
        """Start, inspect, restart, kill a rank of, or stop the lab; run or export a torchrun script; debug a failure.

        %dist start -n 2 [--debug] | status | restart [-n N] | kill R | stop | run FILE.py [ARGS] | export FILE.py
        %dist debug [RANK]: the failed rank's frames and their locals, summarised
        %dist stacks [RANKS] [--native] [--all]: every rank's live frames, read now from outside it
        %dist profile [--steps N] [--warmup W] [--path FILE]: the next %%ddp cell under torch.profiler
        %dist attach [LAB_ID]: take back a lab kept past its kernel (%dist start --keep)
        %dist auto on|off: every plain cell on the ranks, as if it were %%ddp (%%local keeps one here)
        """
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"cannot read %dist arguments: {exc}") from None
        if not words:
            raise UsageError(f"%dist needs a subcommand: {', '.join(_SUBCOMMANDS)} (e.g. %dist start -n 2)")
        sub, rest = words[0], words[1:]
        if sub not in _SUBCOMMANDS:
            raise UsageError(f"unknown subcommand {sub!r} for %dist: use one of {', '.join(_SUBCOMMANDS)}")
        if sub == "start":
            return self._start(start_parser().parse_args(rest))
        if sub == "kill":
            return self._kill(kill_parser().parse_args(rest).rank)
        if sub == "restart":
            return self._restart(restart_parser().parse_args(rest).ranks)
        if sub == "link":
            return self._link(link_parser().parse_args(rest))
        if sub == "run":
            if not rest:
                raise UsageError("%dist run needs a script: %dist run train.py [ARGS...]")
            return self._run(run_parser().parse_args(rest))
        if sub == "export":
            return self._export(export_parser().parse_args(rest).file)
        if sub == "debug":
            return self._debug(debug_parser().parse_args(rest).rank)
        if sub == "stacks":
            return self._stacks(stacks_parser().parse_args(rest))
        if sub == "profile":
            return self._profile(profile_parser().parse_args(rest))
        if sub == "attach":
            return self._attach(rest)
        if sub == "break":
            return break_magic(self._running_lab(), rest)
        if sub in ("step", "continue"):
            no_args_parser(sub).parse_args(rest)
            return step_magic(self._running_lab(), sub)
        if sub == "auto":
            if rest not in (["on"], ["off"]):
                raise UsageError(f"%dist auto takes on or off, got {' '.join(rest) or 'nothing'}: %dist auto on")
            try:
                return self.set_auto(rest == ["on"])
            except LabUsageError as exc:
                raise UsageError(str(exc)) from None
        no_args_parser(sub).parse_args(rest)
        return getattr(self, f"_{sub}")()

    def _start(self, args: argparse.Namespace) -> None:
        from .lab import Lab

        if self.lab is not None and self.lab.running:
            raise UsageError(
                f"a lab of {self.lab.world_size} ranks is already running: %dist stop first, or %dist restart"
            )
        try:
            config = LabConfig.of_args(args, spelling="magic")
            lab = Lab.from_config(config)
            lab.start()
        except LabUsageError as exc:
            raise UsageError(str(exc)) from None
        self.lab = lab
        labs.set_current(lab, self.shell)  # what %exercise and %quiz find: labs.current()
        print(
            f"{ranks_phrase(lab.world_size)} ready{config.where()} on {lab.backend} in {lab.timings['ready_s']:.1f} s "
            f"(launcher {lab.launcher}{', collective checking on' if lab.debug else ''}); "
            "%%ddp cells now run on every rank"
        )
        if lab.note:
            print(lab.note)
        if config.keep:
            print(f"kept: it outlives this kernel; %dist attach {labs.id_of(lab)} in another takes it back "
                  f"(else it ends {config.keep:g} s after this kernel)")

    def _attach(self, rest: list[str]) -> None:
        from .lab import attach

        if len(rest) > 1:
            raise UsageError("%dist attach takes one lab id at most: %dist attach [LAB_ID]")
        if self.lab is not None and self.lab.running:
            raise UsageError(f"a lab of {self.lab.world_size} ranks is running here: %dist stop it first")
        try:
            lab = attach(rest[0] if rest else None)
        except LabUsageError as exc:
            raise UsageError(str(exc)) from None
        self.lab = lab
        labs.set_current(lab, self.shell)
        print(f"attached {ranks_phrase(lab.world_size)} on {lab.backend}, as their cells left them; "
              "%%ddp cells now run on every rank")

    def set_auto(self, on: bool) -> None:
        """Plain cells to the ranks (``on``) or back to the notebook; on needs a running lab."""
        if on and (self.lab is None or not self.lab.running):
            lab = labs.current(self.shell)  # one distlab.start() made in this session
            if lab is None:
                raise LabUsageError("auto mode runs cells on a lab, and none is running: %dist start -n 2 first, "
                                    "then %dist auto on")
            self.lab = lab
        self.auto.on = on
        if self.lab is not None and self.lab.running:
            self.lab.set_every_cell(on)
        if on:
            print(f"auto mode on: every plain cell now runs on the {ranks_phrase(self.lab.world_size)} as if it "
                  "were %%ddp; %%local keeps one here, %dist auto off ends it")
        else:
            print("auto mode off: cells run on the notebook again; %%ddp runs one on the ranks")

    def _running_lab(self) -> Any:
        if self.lab is None or not self.lab.running:
            raise UsageError("no lab is running: start one with %dist start -n 2")
        return self.lab

    def _status(self) -> Any:
        return self._running_lab().status()

    def _restart(self, ranks: int | None = None) -> None:
        lab = self._running_lab()
        try:
            if ranks is not None:
                replace(lab.config, ranks=ranks, spelling="magic")  # checked, named as the flag
            lab.restart(ranks)
        except LabUsageError as exc:
            raise UsageError(str(exc)) from None
        print(f"{ranks_phrase(lab.world_size, 'fresh ')} ready in {lab.timings['restart_s']:.1f} s")

    def _link(self, args: argparse.Namespace) -> None:
        lab = self._running_lab()
        if lab.config.nodes is None:
            raise UsageError(
                "%dist link needs a lab on emulated nodes: start one like %dist start -n 4 --nodes 2 --link 1gbit"
            )
        try:
            if args.rate is None:
                if args.latency is not None:
                    raise LabUsageError(
                        "--latency delays a shaped link: give a rate too, like %dist link 1gbit --latency 1ms"
                    )
            else:
                rate = None if args.rate == "off" else args.rate
                if rate is not None:
                    from ..cluster.nodes import Link

                    Link.parse(rate, args.latency, magic=True)  # checked, named as the magic's arguments
            uplink = None if args.uplink in (None, "off") else args.uplink
            if args.uplink is not None:  # checked before either changes, named as the magic's flags
                replace(lab.config, uplink=uplink, spelling="magic")
                lab.set_uplink(uplink)
            if args.rate is not None:
                lab.set_link(rate, latency=args.latency)
        except LabUsageError as exc:
            raise UsageError(str(exc)) from None
        to = "its rack's switch" if lab.racks else "the switch"
        print(f"link: {lab.link or 'not shaped'} (each way, every node's link to {to})")
        if lab.racks:
            print(f"uplink: {lab.uplink or 'not shaped'} (each way, every rack's link to the spine)")

    def _kill(self, rank: int) -> None:
        lab = self._running_lab()
        try:
            lab.kill(rank)
        except LabUsageError as exc:
            raise UsageError(str(exc)) from None
        print(f"rank {rank} killed (SIGKILL); %dist restart brings the world back")

    def _run(self, args: argparse.Namespace) -> None:
        lab = self._running_lab()
        from ..dashboard.autoshow import autoshow

        try:
            with autoshow(lab):  # the dashboard appears if the script watches a model
                lab.run_script(args.file, args.args, timeout=args.timeout)
        except LabUsageError as exc:
            raise UsageError(str(exc)) from None

    def _export(self, file: str) -> None:
        lab = self._running_lab()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", UserWarning)
                path = lab.export(file)
        except LabUsageError as exc:
            raise UsageError(str(exc)) from None
        print(
            f"wrote {path}; torchrun runs it as it is: torchrun --standalone --nproc_per_node={lab.world_size} {path}"
        )
        for warning in caught:
            print(f"note: {warning.message}")  # what the script lacks of what ran

    def _debug(self, rank: int | None) -> None:
        from IPython.display import display

        from ..errors import DistlabError

        lab = self._running_lab()
        try:
            found = lab.postmortem(rank)
        except (LabUsageError, DistlabError) as exc:
            raise UsageError(str(exc)) from None
        display(found)  # the frames as HTML in a notebook, as text in a terminal

    def _stacks(self, args: argparse.Namespace) -> None:
        from ..errors import DistlabError

        lab = self._running_lab()
        try:
            taken = lab.stacks(args.ranks, native=args.native)
        except (LabUsageError, DistlabError) as exc:
            raise UsageError(str(exc)) from None
        print(taken.text(all_threads=args.all))

    def _profile(self, args: argparse.Namespace) -> None:
        lab = self._running_lab()
        try:
            self._armed = lab.profile(steps=args.steps, warmup=args.warmup, path=args.path)
        except LabUsageError as exc:
            raise UsageError(str(exc)) from None
        print(f"the next %%ddp cell is profiled: {args.steps} steps after {args.warmup} of warmup")

    def _stop(self) -> None:
        if self.lab is None or not self.lab.running:
            print("no lab is running")
            return
        self.lab.stop()
        print("lab stopped: engines and controller are gone"
              + ("; auto mode off: cells run on the notebook" if self.auto.on else ""))
        self.auto.on = False

    # ------------------------------------------------------------------------ %%ddp

    @magic_arguments()
    @argument("-r", "--ranks", default=None, help="run on these ranks only, like 0,2-3")
    @argument("--timeout", type=seconds, default=None, help="seconds the cell may run")
    @argument("--strict", action="store_true", help="run nothing if the lint finds a collective only some ranks reach")
    @argument("--auto", action="store_true", help="(written by auto mode over a plain cell: says so over its output)")
    @cell_magic
    def ddp(self, line: str, cell: str) -> None:
        """Run this cell on every rank (or -r 0,2-3), output streamed and labelled by rank. Before it
        runs, a collective that only some ranks would reach is named, one line each (``distlab.lint``)."""
        args = parse_argstring(self.ddp, line)
        lab = self._running_lab()
        try:
            selected = lab.ranks(args.ranks)
        except LabUsageError as exc:
            raise UsageError(str(exc)) from None
        if args.auto:
            print(f"(auto: on {ranks_phrase(len(selected))}; %%local runs a cell here)")
        found = lab.lint(cell)
        for finding in found:
            print(f"distlab lint: {finding}", file=sys.stderr, flush=True)
        if args.strict and found:
            raise UsageError(f"--strict: nothing ran: mend the {len(found)} line(s) the lint names above, "
                             "or run the cell without --strict")
        from ..dashboard.autoshow import autoshow

        with autoshow(lab):  # the dashboard appears if the cell watches a model
            result = lab.run(cell, ranks=selected, timeout=args.timeout, want="repr")
        if not show_pause(result):
            show_values(result)
        self._armed = show_after(self._armed)  # the profile %dist profile asked for, if this cell filled it


_registered: dict[int, DistMagics] = {}


def register(ipython: Any) -> DistMagics:
    magics = DistMagics(ipython)
    ipython.register_magics(magics)
    ipython.register_magics(LearningMagics(ipython, lambda: magics.lab))
    # First of the transforms IPython runs before it reads a cell's magics: auto mode adds one.
    ipython.input_transformers_cleanup.insert(0, magics.auto)
    _registered[id(ipython)] = magics
    return magics


def auto(on: bool = True) -> None:
    """``%dist auto on|off`` from Python: every plain cell of this notebook on the ranks, or none.
    Loads the extension if it is not loaded; needs a running lab to turn on."""
    from IPython import get_ipython

    checks.flag("on", on)
    shell = get_ipython()
    if shell is None:
        raise LabUsageError("distlab.auto needs IPython or Jupyter, whose cells it runs on the ranks; "
                            "outside them, lab.run(code) runs code on the ranks")
    if id(shell) not in _registered:
        shell.extension_manager.load_extension("distlab")
    _registered[id(shell)].set_auto(on)


def current_lab() -> Any:
    """The lab that %dist started in this IPython session (None if none is running): ``labs.current``."""
    return labs.current()


def unregister(ipython: Any) -> None:
    magics = _registered.pop(id(ipython), None)
    labs.set_current(None, ipython)
    if magics is not None and magics.auto in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(magics.auto)
    if magics is not None and magics.lab is not None:
        magics.lab.stop()
