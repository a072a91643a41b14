"""``lab.profile``: torch.profiler on every rank for a few steps of the next cell, merged into one
Chrome trace, with each rank's compute, communication and their overlap.

:class:`Profiler`, a collaborator of :class:`distlab.front.lab.Lab` (a view: what it shows is
``dashboard.profile``'s), wraps the lab's next cell (``notebook.cells.CellRunner.around``).
``lab.profile(...)`` only arms it here; the ranks are armed when the next cell starts
(``notebook.rpc.start_profile``, on the cell's ranks), their recording stops where the cell ends on
each rank, and after the cell their traces are read (``notebook.rpc.profile_trace``), merged and
written. It sits beside the ``Lab``, above the core and the dashboard, since it drives the one and
shows through the other.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .. import checks
from ..errors import LabUsageError
from ..notebook import rpc
from ..notebook.group import get
from ..notebook.lab_world import LabWorld
from ..notebook.processes import LabProcesses

if TYPE_CHECKING:
    from ..dashboard.profile import RankProfile

__all__ = ["Profile", "Profiler", "profile_parser"]

T = TypeVar("T")


class Profile:
    """What ``lab.profile(steps=...)`` gives: armed for the lab's next cell, then that cell's profile.

    After the cell: ``.path`` (the merged Chrome trace: Perfetto at ui.perfetto.dev, or
    chrome://tracing), ``.table()`` (per rank: steps profiled, compute, communication, exposed
    communication in ms, overlap in %), ``.text()``, and in a notebook the picture of the merged
    timeline with the table under it. ``with lab.profile(steps=3) as prof: lab.run(code)`` disarms
    it on leaving if no cell ran; so does ``prof.disarm()``.
    """

    def __init__(self, profiler: Profiler, steps: int, warmup: int, path: str) -> None:
        self.steps = steps
        self.warmup = warmup
        self._profiler: Profiler | None = profiler
        self._path = path
        #: The merged trace's file, once the profiled cell has ended.
        self.path: str | None = None
        self._profiles: list[RankProfile] | None = None
        self._failed = ""

    @property
    def armed(self) -> bool:
        """Whether the lab's next cell will be profiled by this."""
        return self._profiler is not None and self._profiler.armed is self

    @property
    def done(self) -> bool:
        """Whether the profiled cell has run and its profile is here."""
        return self._profiles is not None

    def disarm(self) -> None:
        """Profile no cell after all (nothing happens if a cell has already been profiled)."""
        if self.armed and self._profiler is not None:
            self._profiler.armed = None
        self._profiler = None

    def __enter__(self) -> Profile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()

    def table(self) -> list[dict[str, Any]]:
        """One dict per rank: ``rank``, ``steps``, ``compute_ms``, ``communication_ms``, ``exposed_ms``,
        ``overlap_pct`` (None where the rank did not communicate)."""
        return [p.row() for p in self._ready()]

    def text(self) -> str:
        """The table as text, with what it was read from and the trace's path."""
        from ..dashboard.profile import table_text

        return table_text(self._ready(), self.path)

    def png(self) -> bytes:
        """The merged timeline (a row per rank) with the table under it, as a PNG."""
        from ..dashboard.profile import render_png

        return render_png(self._ready(), self.text())

    def _ready(self) -> list[RankProfile]:
        if self._profiles is None:
            if self._failed:
                raise LabUsageError(f"nothing was profiled: {self._failed}")
            raise LabUsageError("no cell has been profiled yet: run one (lab.run or a %%ddp cell), then look")
        return self._profiles

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        if self._profiles is None:
            return {"text/plain": repr(self)}
        from ..dashboard.profile import png_base64

        return {"image/png": png_base64(self.png()), "text/plain": self.text()}

    def __repr__(self) -> str:
        if self._profiles is not None:
            return self.text()
        state = "armed for the next cell" if self.armed else self._failed or "not armed"
        return f"<distlab profile of {self.steps} steps (warmup {self.warmup}): {state}>"

    def fail(self, why: str) -> None:
        """The profiled cell failed: nothing to show, and ``why`` is said when asked."""
        self._failed = why
        self._profiler = None

    def finish(self, traces: dict[int, Any]) -> None:
        """The profiled cell has ended: merge the ranks' traces, write the file, keep the numbers."""
        self._profiler = None
        from ..dashboard.profile import merge

        document, profiles = merge({r: t for r, t in traces.items() if t is not None})
        try:
            with open(self._path, "w", encoding="utf-8") as out:
                json_dump(document, out)
        except OSError as exc:
            raise LabUsageError(f"cannot write the profile to {self._path}: {exc.strerror}") from None
        self.path = self._path
        self._profiles = profiles


def json_dump(document: dict[str, Any], out: Any) -> None:
    """Compact JSON: no spaces, no indentation (kineto's own has both: about twice the bytes)."""
    import json

    json.dump(document, out, separators=(",", ":"))


class Profiler:
    """A lab's profiles: the one armed for its next cell (``armed``), on ``processes``' engines as
    ``world`` numbers them; ``lab_id`` names their files."""

    def __init__(self, processes: LabProcesses, world: LabWorld, timeout: float, lab_id: str) -> None:
        self._processes = processes
        self._world = world
        self._timeout = timeout
        self._lab_id = lab_id
        self.armed: Profile | None = None
        self._made = 0

    def profile(
        self, steps: int, warmup: int, path: str | os.PathLike[str] | None, require_running: Callable[[], None]
    ) -> Profile:
        """Arm a profile of ``steps`` steps after ``warmup`` for the lab's next cell (``Lab.profile``
        says what it records); ``require_running()`` refuses it, once the arguments are checked."""
        checks.whole("steps", steps, minimum=1, example="lab.profile(steps=5)")
        checks.whole("warmup", warmup, minimum=0, example="lab.profile(steps=5, warmup=1)")
        where = None if path is None else _checked_path(path)
        require_running()
        self._made += 1
        name = f"distlab-profile-{self._lab_id}-{self._made}.json"
        prof = Profile(self, steps, warmup, name if where is None else where)
        if self.armed is not None:
            self.armed.disarm()  # the latest profile asked for is the one the next cell fills
        self.armed = prof
        return prof

    def around(self, ranks: list[int], run: Callable[[], T]) -> T:
        """``run()``, the lab's next cell on ``ranks``, under the armed profile if there is one."""
        prof = self.armed
        if prof is None:
            return run()
        self.armed = None  # one cell, whatever happens to it
        client, table, timeout = self._processes.client, self._world.table, self._timeout
        engines = {r: client[table[r].engine_id] for r in ranks}
        arming = {r: rpc.start_profile(engine, prof.steps, prof.warmup) for r, engine in engines.items()}
        for r, pending in arming.items():
            get(pending, timeout, f"starting rank {r}'s profiler")
        try:
            result = run()
        except BaseException:
            prof.fail("the profiled cell failed")
            raise
        reading = {r: rpc.profile_trace(engine) for r, engine in engines.items()}
        prof.finish({r: get(pending, timeout, f"reading rank {r}'s profile") for r, pending in reading.items()})
        return result


def _checked_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)) or not str(os.fspath(path)).strip():
        raise LabUsageError(f"path must be a file name, like path='profile.json' (got {path!r})")
    name = str(os.fspath(path))
    folder = os.path.dirname(os.path.abspath(name))
    if os.path.isdir(name) or not os.path.isdir(folder):
        raise LabUsageError(f"cannot write the profile to {name}: give a file in a folder that exists")
    return name


def profile_parser() -> Any:
    """``%dist profile``'s arguments (here: the magics' module is near its size limit)."""
    from IPython.core.magic_arguments import MagicArgumentParser

    def count(flag: str, minimum: int) -> Callable[[str], int]:
        import argparse

        def convert(text: str) -> int:
            try:
                return checks.whole(flag, int(text) if text.lstrip("-").isdigit() else text, minimum=minimum,
                                    example=f"{flag} {max(minimum, 1)}")
            except LabUsageError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        return convert

    p = MagicArgumentParser(prog="%dist profile", add_help=False)
    p.add_argument("--steps", type=count("--steps", 1), default=5, help="optimizer steps to record")
    p.add_argument("--warmup", type=count("--warmup", 0), default=1, help="steps run under the profiler first")
    p.add_argument("--path", default=None, help="the merged trace's file (default: distlab-profile-<lab>-<n>.json)")
    return p


def show_after(prof: Profile | None) -> Profile | None:
    """After a ``%%ddp`` cell: show the profile ``%dist profile`` armed if the cell filled it (its
    picture and table); return it while it still waits for a cell, else None."""
    if prof is None or prof.armed:
        return prof
    if prof.done:
        from IPython.display import display

        display(prof)
    return None
