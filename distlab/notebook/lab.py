"""Lab: the lab a person uses, the core (``core.LabCore``) with its views attached from outside.

The views are observers and poll listeners of the core (``labs.LabObserver``), each owned by its
own module: the side panel's state file (``server.registry.PanelFile``), the ranks' progress bars
(``dashboard.progress.ProgressBars``), a healing cell's quorums and heals
(``dashboard.healing.HealingViews``, behind ``lab.heals()``), the dashboard's background import at start
(``dashboard.autoshow.Prewarm``), the telemetry store behind ``lab.telemetry`` and
``lab.dashboard()``, and ``lab.profile()`` (``profiling.Profiles``, which wraps the next cell).
In a class (``DISTLAB_LIMITS`` set), the class's limits (``classroom.limits.ClassLimits``): checked
before a start or a restart that grows the lab, and its idle end.
The core knows none of them; this module is where they are put together.
"""

from __future__ import annotations

import os
from typing import Any

from ..dashboard.autoshow import Prewarm
from ..dashboard.healing import HealingViews
from ..dashboard.progress import ProgressBars
from ..server.registry import PanelFile
from .core import LabCore, RankInfo, RankTable, RunResult
from .profiling import Profiles

__all__ = ["Lab", "RankInfo", "RankTable", "RunResult", "start"]


class Lab(Profiles, LabCore):
    """N ranks of torch.distributed, each an ipyparallel engine, ready to run cells, with their views.

    Use :func:`distlab.start` (or ``Lab(...).start()``); a Lab is also a context manager that
    stops everything it started on exit.
    """

    def _configure(self, config: Any) -> None:
        super()._configure(config)
        self._telemetry: Any = None  # distlab.dashboard.TelemetryStore, made on first use
        self.observe(PanelFile())  # the side panel's view of this lab
        self.observe(ProgressBars())  # the ranks' tqdm bars: one widget in a cell's output
        self._heal_views = HealingViews()  # a healing cell's quorums and heals: a view in its output
        self.observe(self._heal_views)
        self.observe(Prewarm())  # after the ranks are up: the import would compete with their start
        self._class_limits: Any = None  # classroom.limits.ClassLimits, in a class
        # The name is classroom.limits.ENV_VAR's, written here so that a lab outside a class imports nothing of it.
        if os.environ.get("DISTLAB_LIMITS", "").strip():
            from ..classroom.limits import ClassLimits

            self._class_limits = ClassLimits.from_env()  # wrong text: one line (LabUsageError), no lab
            self.observe(self._class_limits)

    def start(self) -> Any:
        """Start the lab (``LabCore.start``); in a class, refused first if it would break its limits."""
        if self._class_limits is not None and not self.running:
            self._class_limits.check_start(self)  # before any process starts
        return super().start()

    def restart(self, ranks: int | None = None) -> Any:
        """A fresh world (``LabCore.restart``); in a class, one that grows the lab is refused first if it
        would break its limits."""
        if self._class_limits is not None and ranks is not None and self.running:
            self._class_limits.check_restart(self, ranks)
        return super().restart(ranks)

    def _on_poll(self, pending: dict[int, Any], final: bool) -> None:
        # The telemetry store reads what the ranks published before any listener looks at it, even
        # a store made during this cell (by a listener, or anew after a restart at another size).
        if self._telemetry is not None and self._telemetry.world_size == self.world_size:
            self._telemetry.on_poll(pending, final)
        super()._on_poll(pending, final)

    @property
    def telemetry(self) -> Any:
        """What ``distlab.watch(model)`` publishes on the ranks: ``lab.telemetry.records()``.

        A ``distlab.dashboard.TelemetryStore``, made and fed from the first use on; it also picks up
        what earlier cells of this world published. Telemetry is per world size: after a restart at
        another size, the next use makes a store (and dashboard) of the new size.
        """
        if self._telemetry is None or self._telemetry.world_size != self.world_size:
            from ..dashboard.store import TelemetryStore

            store = TelemetryStore(self.world_size)
            if self._client is not None:
                # The client's metadata keeps every message since it connected, those of engines of
                # an earlier world too: only this world's engines' count.
                engines = {info.engine_id for info in self.table}
                store.backfill(
                    md for md in list(self._client.metadata.values())
                    if hasattr(md, "get") and md.get("engine_id") in engines
                )
            self._telemetry = store
        return self._telemetry

    def heals(self) -> Any:
        """What the last cell that healed did (``distlab.heal``): ``print(lab.heals())``.

        A ``distlab.dashboard.quorums.HealingRecord``: ``steps``, each step's quorum (its ranks,
        and the participants whose gradients it averaged); ``skipped``, rank -> the steps whose
        quorum it was not in (it had died, or its replacement had not healed yet); ``heals``, each
        replacement's heal (from which rank, at which step, bytes, seconds). None before any cell healed.
        """
        return self._heal_views.last

    def dashboard(self) -> Any:
        """The live dashboard of this lab's telemetry (ipywidgets + plotly); one per lab."""
        from ..dashboard.view import dashboard_for

        return dashboard_for(self.telemetry)


def start(
    ranks: int = 2, backend: str = "auto", timeout: float = 30.0, launcher: str = "local", debug: bool = False,
    nodes: int | None = None, link: str | None = None, latency: str | float | None = None, subnet: str | None = None,
    heal: bool = False, spares: int | None = None, racks: int | None = None, uplink: str | None = None,
    keep: bool | float = False,
) -> Lab:
    """Start a lab of ``ranks`` torch.distributed ranks and return it, ready to run cells.

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
    lab: Lab = Lab(
        ranks=ranks, backend=backend, timeout=timeout, launcher=launcher, debug=debug,
        nodes=nodes, link=link, latency=latency, subnet=subnet, heal=heal, spares=spares,
        racks=racks, uplink=uplink, keep=keep,
    ).start()
    return lab
