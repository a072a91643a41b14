"""Lab: the lab a person uses, the core (``notebook.core.LabCore``) with its views attached from outside.

The views are observers and poll listeners of the core's bus (``notebook.observers``), each owned by its own
module: the side panel's state file (``server.registry.PanelFile``), the ranks' progress bars
(``dashboard.progress.ProgressBars``), a healing cell's quorums and heals as they come
(``dashboard.healing.HealingViews``, drawing the core's ``notebook.healing.HealingRecords``), the dashboard's
background import at start (``dashboard.autoshow.Prewarm``), the telemetry store behind
``lab.telemetry`` and ``lab.dashboard()``, and ``lab.profile()`` (``profiling.Profiler``, which wraps
the next cell). In a class (``DISTLAB_LIMITS`` set), the class's limits (``classroom.limits.ClassLimits``):
checked before a start or a restart that grows the lab, and its idle end. Here too are the lab's
emulated network (``notebook.nodes.NetworkControls``) and its live stacks (``notebook.stacks.StacksReader``), which a
companion (a plain core) does without.

The core knows none of the views, and the views know neither the core nor this ``Lab`` (they are told an
``ObservedLab``, ``notebook.observers``): this module, above both, is where they are put together.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..cluster.nodes import Link
from ..cluster.stacks import Stacks
from ..dashboard.autoshow import Prewarm
from ..dashboard.healing import HealingViews
from ..dashboard.progress import ProgressBars
from ..notebook import kept, labs
from ..notebook.config import LabConfig
from ..notebook.core import LabCore, RankInfo, Ranks, RankTable, RunResult
from ..server.registry import PanelFile
from .profiling import Profile, Profiler

if TYPE_CHECKING:
    from ..classroom.limits import ClassLimits
    from ..dashboard.store import TelemetryStore
    from ..dashboard.view import Dashboard
    from ..ipycompat import IppAsyncResult
    from ..notebook.healing_record import HealingRecord

__all__ = ["Lab", "RankInfo", "RankTable", "RunResult", "attach", "current", "start"]


class Lab(LabCore):
    """N ranks of torch.distributed, each an ipyparallel engine, ready to run cells, with their views.

    Use :func:`distlab.start` (or ``Lab(...).start()``); a Lab is also a context manager that
    stops everything it started on exit.
    """

    def __init__(self, *args: Any, config: LabConfig | None = None, **overrides: Any) -> None:
        super().__init__(*args, config=config, **overrides)
        self._telemetry: TelemetryStore | None = None  # made on first use
        self.add_listener(self._feed_telemetry)  # first: the store reads a poll before any other listener
        self.profiler = Profiler(self.processes, self.world, self.config.timeout, labs.id_of(self))
        self.cells.around = self.profiler.around
        self.observe(PanelFile())  # the side panel's view of this lab
        self.observe(ProgressBars())  # the ranks' tqdm bars: one widget in a cell's output
        self.observe(HealingViews(self.healer.records))  # a healing cell's quorums and heals, in its output
        self.observe(Prewarm())  # after the ranks are up: the import would compete with their start
        self.class_limits: ClassLimits | None = None  # in a class
        # The name is classroom.limits.ENV_VAR's, written here so that a lab outside a class imports nothing of it.
        if os.environ.get("DISTLAB_LIMITS", "").strip():
            from ..classroom.limits import ClassLimits

            self.class_limits = ClassLimits.from_env()  # wrong text: one line (LabUsageError), no lab
            if self.class_limits is not None:  # always: the variable is set (its None is for unset)
                self.observe(self.class_limits)

    def start(self) -> Lab:
        """Start the lab (``LabCore.start``); in a class, refused first if it would break its limits."""
        if self.class_limits is not None and not self.running:
            self.class_limits.check_start(self)  # before any process starts
        return super().start()

    def restart(self, ranks: int | None = None) -> Lab:
        """A fresh world (``LabCore.restart``); in a class, one that grows the lab is refused first if it
        would break its limits."""
        if self.class_limits is not None and ranks is not None and self.running:
            self.class_limits.check_restart(self, ranks)
        return super().restart(ranks)

    # ------------------------------------------------------------------ telemetry and profiles

    def _feed_telemetry(self, pending: dict[int, IppAsyncResult], final: bool) -> None:
        # Even a store made during this cell (by a listener, or anew after a restart at another size).
        if self._telemetry is not None and self._telemetry.world_size == self.world_size:
            self._telemetry.on_poll(pending, final)

    @property
    def telemetry(self) -> TelemetryStore:
        """What ``distlab.watch(model)`` publishes on the ranks: ``lab.telemetry.records()``.

        A ``distlab.dashboard.TelemetryStore``, made and fed from the first use on; it also picks up
        what earlier cells of this world published. Telemetry is per world size: after a restart at
        another size, the next use makes a store (and dashboard) of the new size.
        """
        if self._telemetry is None or self._telemetry.world_size != self.world_size:
            from ..dashboard.store import TelemetryStore

            store = TelemetryStore(self.world_size)
            client = self.processes.client
            if client is not None:
                # The client's metadata keeps every message since it connected, those of engines of
                # an earlier world too: only this world's engines' count.
                engines = self.world.engine_ids
                store.backfill(
                    md for md in list(client.metadata.values())
                    if hasattr(md, "get") and md.get("engine_id") in engines
                )
            self._telemetry = store
        return self._telemetry

    def dashboard(self) -> Dashboard:
        """The live dashboard of this lab's telemetry (ipywidgets + plotly); one per lab."""
        from ..dashboard.view import dashboard_for

        return dashboard_for(self.telemetry)

    def profile(self, steps: int = 5, warmup: int = 1, path: str | os.PathLike[str] | None = None) -> Profile:
        """Profile the next cell run through this lab (``lab.run``, a ``%%ddp`` cell, ``%dist run``)
        with torch.profiler on each of its ranks; returns the :class:`~distlab.front.profiling.Profile` it fills.

        A step is one ``optimizer.step()`` on a rank. The cell's first step (its set-up, DDP's first
        iteration) is not profiled; then ``warmup`` steps run under the profiler unrecorded, and the
        next ``steps`` are recorded (torch.profiler's ``schedule(wait=0, warmup=warmup,
        active=steps, repeat=1)``). A cell with fewer steps keeps what was recorded; a cell with no
        optimizer is profiled whole. The ranks' traces are merged into ``path`` (default:
        ``distlab-profile-<lab id>-<n>.json`` in the current folder). ``%dist profile --steps 5``.
        Also a context manager: leaving it disarms the profile if no cell ran.
        """
        return self.profiler.profile(steps, warmup, path, require_running=self._require_running)

    # ------------------------------------------------------------------ what ranks are doing

    def stacks(self, ranks: Ranks = None, native: bool = False, timeout: float = 10.0) -> Stacks:
        """Every rank's live frames (the given ranks, all by default), read from outside its process:
        ``print(lab.stacks())``, ``%dist stacks``. Ranks with the same stack are shown once.

        It answers while a cell runs (call it from another thread, or the side panel's Stacks
        button) and from a rank stuck in a collective, which answers nothing itself. ``native=True``
        adds the C and C++ frames (torch's, gloo's; slower). Each stack is cut to the user's code;
        ``.text(all_threads=True)`` shows every thread. Ranks on another machine are named, not read.
        Needs py-spy (a dependency of distlab) and permission to trace the ranks (ptrace).
        """
        self._require_running()
        return self.stacks_reader.stacks(self.ranks(ranks), native, timeout)

    def heals(self) -> HealingRecord | None:
        """What the last cell that healed did (``distlab.heal``): ``print(lab.heals())``.

        A ``distlab.notebook.healing_record.HealingRecord``: ``steps``, each step's quorum (its ranks,
        and the participants whose gradients it averaged); ``skipped``, rank -> the steps whose
        quorum it was not in (it had died, or its replacement had not healed yet); ``heals``, each
        replacement's heal (from which rank, at which step, bytes, seconds). None before any cell healed.
        """
        return self.healer.records.last

    # ------------------------------------------------------------------ the emulated network

    @property
    def link(self) -> Link | None:
        """The link between nodes now (``.rate_bps``, ``.latency_s``; prints as "1gbit"); None where
        nothing is shaped (no nodes, or nodes with an unshaped link)."""
        return self.network.link

    def set_link(self, rate: str | None, latency: str | float | None = None) -> Link | None:
        """Reshape every node's link, both ways, between cells: ``lab.set_link("100mbit")``.

        ``latency`` adds a one-way delay between nodes where the kernel has netem. ``None`` as the
        rate takes the shaping off. Returns the new link.
        """
        self._require_running()
        self.config = self.network.set_link(self.config, rate, latency)
        self.bus.tell("changed")
        return self.config.node_link()

    @property
    def uplink(self) -> Link | None:
        """Each rack's uplink to the spine now; None where nothing is shaped there (no racks, or not shaped)."""
        return self.network.uplink

    @property
    def racks(self) -> list[list[int]]:
        """The ranks in each rack, rack by rack ([] for a lab without racks): who shares the fast links."""
        return self.network.racks(self.table)

    def set_uplink(self, rate: str | None) -> Link | None:
        """Reshape every rack's uplink to the spine, both ways, between cells: ``lab.set_uplink("100mbit")``.
        ``None`` takes the shaping off. Returns the new uplink."""
        self._require_running()
        self.config = self.network.set_uplink(self.config, rate)
        self.bus.tell("changed")
        return self.config.rack_uplink()

    def link_bytes(self) -> dict[int, int]:
        """{node: bytes it has sent onto its link so far}, as the kernel's queue counted them (frames,
        headers included). Take it before and after a cell to see what crossed the links."""
        self._require_running()
        return self.network.link_bytes()

    def uplink_bytes(self) -> dict[int, tuple[int, int]]:
        """{rack: (bytes it sent up to the spine, bytes it received down from it)} so far, as the
        kernel's queues counted them. Take it before and after a cell to see what crossed between racks."""
        self._require_running()
        return self.network.uplink_bytes()


def start(*args: Any, config: LabConfig | None = None, **overrides: Any) -> Lab:
    """Start a lab of ``ranks`` torch.distributed ranks and return it, ready to run cells.

    Takes :class:`~distlab.notebook.config.LabConfig`'s keywords, each documented there: ``ranks``,
    ``backend``, ``timeout``, ``launcher``, ``debug``, ``nodes``, ``link``, ``latency``, ``subnet``,
    ``racks``, ``uplink``, ``heal``, ``spares``, ``keep`` (or ``config=``, a checked one).

    ``debug=True`` turns on torch's collective checking on every rank (TORCH_DISTRIBUTED_DEBUG=DETAIL):
    mismatched collectives fail at once, named; everything runs slower.

    ``nodes=2, link="1gbit"`` spreads the ranks over emulated nodes: network namespaces on this
    machine, each with its own address, joined to a switch by links shaped to ``link`` both ways
    (``latency="200us"`` adds delay where the kernel has netem). Ranks on one node talk over its
    loopback, ranks on different nodes over the links. Needs root (CAP_NET_ADMIN).
    ``racks=2, uplink="1gbit"`` puts the nodes in racks, two tiers as in a real cluster: each node's
    link ends at its rack's switch, each rack reaches the others through one uplink to a spine.

    ``heal=True`` runs torchft's lighthouse beside the ranks: in a cell, ``model, opt =
    distlab.heal(model, opt)`` gives a per-step quorum, and a rank's death does not stop the others.

    ``spares``: engines kept started and registered beside the ranks, which a restart or a dead rank's
    replacement takes instead of starting new ones (a restart then takes ~0.15 s instead of ~0.8 s).
    By default one per rank in a local lab without nodes (forked, ~36 MB each of their own), else none.

    ``keep=True`` keeps the lab past its kernel's end, for ``distlab.attach()`` in another kernel to
    take back, ranks and all; one that nobody attaches ends an hour later (``keep=600``: in 600 s).
    """
    lab: Lab = Lab(*args, config=config, **overrides).start()
    return lab


def attach(lab_id: str | None = None, timeout: float | None = None) -> Lab:
    """Take back a lab kept past its kernel (``start(keep=True)``): the only free one, or ``lab_id``;
    its ranks, as their cells left them (``%dist attach [LAB_ID]``).

    The lab it gives is this kernel's, as if it had started it: it runs cells, stops, and is kept
    again when this kernel ends (``keep`` still holds)."""
    lab: Lab = kept.attach(lab_id, timeout, factory=Lab.from_config)
    return lab


def current(shell: Any = None) -> Lab | None:
    """The running lab ``%dist start`` made in this IPython session, or None (``distlab.current_lab()``)."""
    lab = labs.current(shell)
    return lab if isinstance(lab, Lab) else None
