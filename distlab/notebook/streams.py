"""Client side: re-print each rank's output as it arrives, one line at a time, labelled by rank,
a line that several ranks printed alike shown once with their ranks; show what a rank displays
(HTML, images, Markdown, figures, tables, widgets) under its label."""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from ..errors import format_ranks

#: The MIME type of a displayed ipywidget: its model lives on the rank.
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
#: How long a line waits for the other ranks to print the same (then it shows with the ranks that did).
HOLD_S = 0.3
#: Lines held at most; more new lines than this from a rank at once are a flood, printed as they came.
MAX_HELD = 64

#: What a lab that heals keeps out of the ranks' output: torchft's DDP wrapper always passes
#: ``find_unused_parameters=True`` (so that its buckets are never rebuilt, torchft/ddp.py), and
#: torch's reducer then warns, once per process in C++, that it found none: about torchft's
#: choice, not the learner's code. On emulated nodes a replacement's store also says it cannot
#: look up its peer's name (a node's namespace has no resolver for the lab's addresses), which
#: changes nothing: connections are by address.
HEALING_NOISE = (
    re.compile(r"reducer\.cpp:\d+\] Warning: find_unused_parameters=True was specified in DDP constructor, "
               r"but did not find any unused parameters"),
    re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved"),
)


@dataclass
class _Held:
    """A line waiting for the cell's other ranks to print it too."""

    stream: str
    text: str
    ranks: list[int]
    seq: int  # the order lines arrived in
    since: float  # when it arrived (time.monotonic)


class RankPrinter:
    """Tracks how much of each rank's accumulated stdout/stderr has been printed, and prints it.

    ipyparallel accumulates each engine's output in the AsyncResult's metadata; we print the new
    part, complete lines only (so "[rank 1] " never lands in the middle of rank 0's line), and
    the unfinished tail when the cell ends.

    With 8 ranks, "epoch 1 done" would show 8 times. A line is held until the cell's other ranks
    have printed the same (then it shows once: ``[ranks 0-7] epoch 1 done``), or have printed a
    line after it, or ended, or ``HOLD_S`` passed: then it shows with the ranks that printed it.
    Lines that differ stay per rank, and each rank's lines keep their order.
    """

    def __init__(self, label_width: int = 1, ranks: Iterable[int] = (), hidden: Iterable[re.Pattern[str]] = ()) -> None:
        self._printed: dict[tuple[int, str], int] = {}
        self._hidden = tuple(hidden)  # lines not shown (``HEALING_NOISE``)
        self._shown: dict[int, int] = {}
        self._width = label_width
        self._ranks = set(ranks)  # the cell's: a line all of them printed shows at once
        self._held: list[_Held] = []
        self._seq = 0
        self._latest: dict[int, int] = {}  # rank -> the seq of its latest line

    def feed(self, rank: int, name: str, text: str, final: bool = False) -> None:
        """Take what rank ``rank`` has printed so far on ``name``; its complete lines join the held
        ones (:meth:`flush` prints them). A cell of one rank has nothing to fold: it prints at once."""
        key = (rank, name)
        done = self._printed.get(key, 0)
        new = text[done:]
        cut = len(new) if final else new.rfind("\n") + 1
        if cut > 0:
            self._printed[key] = done + cut
            lines = [line for line in new[:cut].splitlines() if not any(p.search(line) for p in self._hidden)]
            if not lines:
                return
            if len(self._ranks) <= 1 or len(lines) > MAX_HELD:
                # Nothing to fold with, or a flood (folding is for what a person reads): as it came.
                self._print(len(self._held))
                stream: TextIO = sys.stderr if name == "stderr" else sys.stdout
                prefix = self._label(rank) + " "
                stream.write("".join(prefix + line + "\n" for line in lines))
                stream.flush()
                return
            for line in lines:
                self._hold(rank, name, line)

    def _hold(self, rank: int, stream: str, text: str) -> None:
        self._seq += 1
        self._latest[rank] = self._seq
        # It joins the same line held for other ranks where the rank's order can be kept: its own
        # held lines after that one, if any, must be its alone; they move before it (which changes
        # no other rank's order).
        mine = [i for i, held in enumerate(self._held) if rank in held.ranks]
        for j, held in enumerate(self._held):
            if held.stream != stream or held.text != text or rank in held.ranks:
                continue
            later = [i for i in mine if i > j]
            if all(self._held[i].ranks == [rank] for i in later):
                moved = [self._held[i] for i in later]
                for i in reversed(later):
                    del self._held[i]
                self._held[j:j] = moved
                held.ranks.append(rank)
                return
        self._held.append(_Held(stream, text, [rank], self._seq, time.monotonic()))
        if len(self._held) > MAX_HELD:  # a flood of lines: folding is for what a person reads
            self._print(len(self._held) - MAX_HELD)

    def flush(self, final: bool = False, ended: Collection[int] = ()) -> None:
        """Print the held lines that are settled, in order: every rank of the cell printed them, or
        moved past them (printed a later line, or ``ended``), or ``HOLD_S`` passed; all if ``final``."""
        now, settled = time.monotonic(), 0
        after = Counter(r for held in self._held for r in held.ranks)  # each rank's held lines from here on
        for held in self._held:
            after.subtract(held.ranks)
            waiting = any(
                r not in held.ranks and r not in ended and after[r] == 0 and self._latest.get(r, 0) < held.seq
                for r in self._ranks
            )
            if waiting and not final and now - held.since < HOLD_S:
                break
            settled += 1
        self._print(settled)

    def _print(self, count: int) -> None:
        """Print the first ``count`` held lines."""
        out, self._held = self._held[:count], self._held[count:]
        for held in out:
            stream: TextIO = sys.stderr if held.stream == "stderr" else sys.stdout
            stream.write(f"{self._label(*sorted(held.ranks))} {held.text}\n")
        for name in {held.stream for held in out}:
            (sys.stderr if name == "stderr" else sys.stdout).flush()

    def forget(self, rank: int) -> None:
        """A new process took rank ``rank``'s place: its output starts from nothing."""
        self.flush(final=True)
        self._printed = {key: n for key, n in self._printed.items() if key[0] != rank}
        self._shown.pop(rank, None)
        self._latest.pop(rank, None)

    def show(self, rank: int, outputs: list[dict[str, Any]]) -> None:
        """Display the rank's rich outputs not shown yet (ipyparallel's ``AsyncResult.outputs``), each
        under a ``[rank N]`` line.

        In a Jupyter kernel each goes out as the rank made it: the notebook renders HTML, images,
        Markdown, plotly figures and tables, and a widget made on the rank is live there, because
        ipyparallel relays the rank's widget messages to the kernel's front end. Elsewhere (a
        terminal, a script) nothing can render them: the text form is printed, and a widget says
        that it shows only in a notebook.
        """
        done = self._shown.get(rank, 0)
        new = outputs[done:]
        if not new:
            return
        self._shown[rank] = done + len(new)
        self.flush(final=True)  # the lines printed before it come first
        shell = _kernel_shell()
        for output in new:
            data = output.get("data", {})
            if shell is not None:
                sys.stdout.write(self._label(rank) + "\n")
                sys.stdout.flush()
                from IPython.display import publish_display_data

                publish_display_data(data, output.get("metadata") or {})
                continue
            text = data.get("text/plain", "")
            if WIDGET_MIME in data:
                text += "  (a widget made on the rank: it shows only in a Jupyter notebook)"
            sys.stdout.write("".join(f"{self._label(rank)} {line}\n" for line in (text.splitlines() or [""])))
            sys.stdout.flush()

    def _label(self, *ranks: int) -> str:
        if len(ranks) > 1:
            return f"[ranks {format_ranks(ranks)}]"
        return f"[rank {ranks[0]:>{self._width}}]"


def _kernel_shell() -> Any:
    """The IPython shell when this process is a Jupyter kernel (rich outputs render), else None."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return None
    shell = get_ipython()
    return shell if getattr(shell, "kernel", None) is not None else None
