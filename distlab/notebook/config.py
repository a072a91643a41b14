"""A lab's configuration: one frozen dataclass, checked once, made alike by ``distlab.start`` and ``%dist start``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, fields, replace
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .. import checks
from ..errors import LabUsageError

if TYPE_CHECKING:
    from ..cluster.links import Link

__all__ = ["BACKENDS", "LabConfig", "lab_config", "launcher_names", "mpi_spans_hosts"]

BACKENDS = ("auto", "gloo", "nccl")

# How each field is written, and an example of it, in Python and in the magics: a message names
# the value the way the user wrote it.
_SPELLING = {
    "python": {
        "ranks": ("ranks", "ranks=2"), "timeout": ("timeout", "timeout=30"), "debug": ("debug", "debug=True"),
        "nodes": ("nodes", "nodes=2"), "link": ("link", 'link="1gbit"'), "latency": ("latency", 'latency="200us"'),
        "subnet": ("subnet", 'subnet="198.18.7.0/24"'), "launcher": ("launcher", 'launcher="local"'),
        "heal": ("heal", "heal=True"), "backend": ("backend", 'backend="gloo"'),
        "spares": ("spares", "spares=2"), "racks": ("racks", "racks=2"), "uplink": ("uplink", 'uplink="1gbit"'),
        "keep": ("keep", "keep=True"),
    },
    "magic": {
        "ranks": ("-n", "-n 2"), "timeout": ("--timeout", "--timeout 30"), "debug": ("--debug", "--debug"),
        "nodes": ("--nodes", "--nodes 2"), "link": ("--link", "--link 1gbit"),
        "latency": ("--latency", "--latency 200us"),
        "subnet": ("--subnet", "--subnet 198.18.7.0/24"), "launcher": ("--launcher", "--launcher local"),
        "heal": ("--heal", "--heal"), "backend": ("--backend", "--backend gloo"),
        "spares": ("--spares", "--spares 2"), "racks": ("--racks", "--racks 2"),
        "uplink": ("--uplink", "--uplink 1gbit"), "keep": ("--keep", "--keep 3600"),
    },
}


_SECONDS = "a number of seconds"
#: How long a kept lab that nobody attaches waits, after its kernel is gone, before it ends.
KEEP_IDLE_S = 3600.0


# Where a batch system or Open MPI is told of more than one host: mpiexec then starts ranks there.
_HOSTFILE_VARIABLES = (
    "OMPI_MCA_orte_default_hostfile", "OMPI_MCA_rmaps_base_hostfile", "PRTE_MCA_prte_default_hostfile"
)
_NODE_COUNTS = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES")
_NODE_LISTS = ("PBS_NODEFILE", "LSB_DJOB_HOSTFILE")


def mpi_spans_hosts(environ: Mapping[str, str]) -> bool:
    """Whether ``mpiexec`` started from this environment may place ranks on other hosts: inside a
    Slurm, PBS or LSF allocation of more than one node, or with a default host file set for Open MPI.
    With none of these, Open MPI starts every rank on this machine."""
    for name in _NODE_COUNTS:
        with contextlib.suppress(ValueError):
            if int(environ.get(name, "1")) > 1:
                return True
    for name in _NODE_LISTS:
        path = environ.get(name)
        if path:
            try:
                with open(path) as hosts:
                    if len({line.split()[0] for line in hosts if line.strip()}) > 1:
                        return True
            except OSError:
                return True  # named but unreadable here: assume the allocation is what it says
    return any(environ.get(name) for name in _HOSTFILE_VARIABLES)


def launcher_names() -> list[str]:
    """ipyparallel's engine launchers installed here (local, mpi, ssh, slurm, ...)."""
    return sorted({ep.name for ep in entry_points(group="ipyparallel.engine_launchers")})


@dataclass(frozen=True)
class LabConfig:
    """How to start a lab. Every field is checked on construction: a bad value raises
    ``LabUsageError`` naming it and the fix, before anything starts."""

    #: The world size.
    ranks: int = 2
    #: ``auto``: NCCL where every rank has a GPU, else gloo.
    backend: str = "auto"
    #: Seconds any wait may take (start-up, rendezvous, a collective).
    timeout: float = 30.0
    #: ipyparallel's engine launcher.
    launcher: str = "local"
    #: torch's collective checking (TORCH_DISTRIBUTED_DEBUG=DETAIL) on every rank.
    debug: bool = False
    #: Emulated nodes the ranks are spread over: network namespaces on this machine, each with its
    #: own address, joined to a switch (``cluster.nodes``). None: every rank on loopback.
    nodes: int | None = None
    #: Each node's link to the switch, both ways, in tc's units ("1gbit"); None: not shaped.
    link: str | None = None
    #: Delay added one way between two nodes ("200us"), where the kernel has netem.
    latency: str | float | None = None
    #: The lab network's IPv4 subnet; None: a free /24 of 198.18.0.0/15 (RFC 2544's benchmarking range).
    subnet: str | None = None
    #: Racks the nodes are in, two tiers as in a real fabric: each node links to its rack's switch,
    #: each rack to a spine by one uplink (``cluster.nodes``). None: every node on one switch.
    racks: int | None = None
    #: Each rack's uplink to the spine, both ways, in tc's units ("1gbit"); None: not shaped.
    uplink: str | None = None
    #: Per-step quorum on torchft: when a rank dies the others go on (``rank.heal``, ``cluster.lighthouse``).
    heal: bool = False
    #: Engines kept started and registered beside the world, for a restart or a dead rank's replacement
    #: to take instead of starting new ones (``notebook.spares``). None: as many as the world has
    #: ranks where they are forked from the warm template (a local lab without nodes), else none.
    spares: int | None = None
    #: Outlive the kernel on purpose (``notebook.kept``): True, or the seconds that a lab nobody
    #: attaches (``distlab.attach``) waits, once its kernel is gone, before it ends (True: ``KEEP_IDLE_S``).
    #: Normalised to seconds; 0: not kept, the lab ends with its kernel.
    keep: bool | float = False
    #: "magic" when the values come from ``%dist``: messages then name its flags.
    spelling: InitVar[str] = "python"

    @classmethod
    def of_args(cls, args: Any, spelling: str = "python") -> LabConfig:
        """The configuration of an object's attributes named as the fields are (``%dist start``'s flags)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)}, spelling=spelling)

    def __post_init__(self, spelling: str) -> None:
        say = _SPELLING[spelling]
        checks.whole(say["ranks"][0], self.ranks, minimum=1, example=say["ranks"][1])
        checks.choice("backend", self.backend, BACKENDS)
        timeout = checks.positive(say["timeout"][0], self.timeout, example=say["timeout"][1], kind=_SECONDS)
        object.__setattr__(self, "timeout", timeout)
        names = launcher_names()
        if not isinstance(self.launcher, str) or self.launcher.lower() not in names:
            raise LabUsageError(f"unknown launcher {self.launcher!r}: choose one of {', '.join(names)}")
        object.__setattr__(self, "launcher", self.launcher.lower())
        checks.flag(say["debug"][0], self.debug)
        self._check_nodes(say)
        self._check_heal(say)
        self._check_keep(say)
        self._check_spares(say)

    def _check_keep(self, say: dict[str, tuple[str, str]]) -> None:
        keep = say["keep"][0]
        if self.keep is False or self.keep == 0:
            object.__setattr__(self, "keep", 0.0)
            return
        idle = KEEP_IDLE_S if self.keep is True else checks.positive(
            keep, self.keep, example=say["keep"][1], kind=_SECONDS)
        object.__setattr__(self, "keep", idle)
        if self.launcher != "local" or self.nodes or self.heal:
            what = (f"{say['launcher'][0]} {self.launcher}" if self.launcher != "local"
                    else say["nodes"][0] if self.nodes else say["heal"][0])
            raise LabUsageError(
                f"{keep} keeps a lab whose processes all run on this machine's loopback, as the local launcher "
                f"starts them: leave out {what}, or {keep}"
            )

    def _check_spares(self, say: dict[str, tuple[str, str]]) -> None:
        if self.spares is None:
            return
        checks.whole(say["spares"][0], self.spares, minimum=0, example=say["spares"][1])
        if self.spares and not self.forks_spares:
            why = (f"{say['nodes'][0]} starts ranks inside the nodes" if self.nodes
                   else f"a lab kept with {say['keep'][0]} starts its ranks cold" if self.keep
                   else "ranks are started cold here (DISTLAB_WARM=0)" if self.launcher == "local"
                   else f"the {self.launcher} launcher starts ranks elsewhere")
            raise LabUsageError(
                f"{say['spares'][0]} keeps engines forked from this machine's warm template, and {why}: "
                f"leave out {say['spares'][0]}"
            )

    @property
    def forks_spares(self) -> bool:
        """Whether this lab's engines are forked from the warm template, so that it can keep spares."""
        from ..cluster import warm

        # A kept lab's engines are started cold: forked ones would be the warm template's, which ends
        # with its kernel.
        return self.launcher == "local" and not self.nodes and not self.keep and warm.enabled()

    @property
    def spare_count(self) -> int:
        """How many spare engines the lab keeps: ``spares``, or by default one per rank where it can."""
        if self.spares is not None:
            return self.spares
        return self.ranks if self.forks_spares else 0

    def _check_heal(self, say: dict[str, tuple[str, str]]) -> None:
        checks.flag(say["heal"][0], self.heal)
        if not self.heal:
            return
        heal = say["heal"][0]
        if self.launcher != "local":
            raise LabUsageError(
                f"{heal} needs the ranks on this machine, where the lab runs torchft's lighthouse: "
                f"leave out {say['launcher'][0]} {self.launcher} (or {heal}, and restart from a checkpoint instead)"
            )
        if self.backend == "nccl":
            raise LabUsageError(
                f"{heal} runs its quorum's collectives on gloo here: use {say['backend'][1]} "
                f"(or leave out {heal}, and restart from a checkpoint instead)"
            )
        from ..cluster.lighthouse import executable

        executable()  # torchft installed, or one line saying how
        if self.backend == "auto":
            object.__setattr__(self, "backend", "gloo")  # "auto" lets distlab choose: healing's is gloo

    def _check_nodes(self, say: dict[str, tuple[str, str]]) -> None:
        from ..cluster.nodes import Link, check_subnet, require_namespaces

        nodes = say["nodes"]
        if self.nodes is None:
            for field in ("link", "latency", "subnet", "racks", "uplink"):
                if getattr(self, field) is not None:
                    sep = " " if say is _SPELLING["magic"] else ", "
                    raise LabUsageError(
                        f"{say[field][0]} sets the network between nodes: give {nodes[0]} too, "
                        f"like {nodes[1]}{sep}{say[field][1]}"
                    )
            return
        checks.whole(nodes[0], self.nodes, minimum=1, example=nodes[1])
        if self.nodes > self.ranks:
            raise LabUsageError(
                f"{nodes[0]} {self.nodes} is more nodes than ranks ({say['ranks'][0]} {self.ranks}): every node needs "
                f"a rank; use at most {self.ranks} nodes, or more ranks"
            )
        if self.launcher != "local":
            raise LabUsageError(
                f"{nodes[0]} starts the ranks in namespaces on this machine with the local launcher: "
                f"leave out {say['launcher'][0]} {self.launcher}"
            )
        if self.link is not None:
            Link.parse(self.link, self.latency, magic=say is _SPELLING["magic"])
        elif self.latency is not None:
            raise LabUsageError(
                f"{say['latency'][0]} delays a shaped link: give {say['link'][0]} too, like {say['link'][1]}"
            )
        if self.subnet is not None:
            check_subnet(self.subnet, self.nodes, say["subnet"])
        self._check_racks(say)
        require_namespaces(nodes[0])

    def _check_racks(self, say: dict[str, tuple[str, str]]) -> None:
        from ..cluster.links import parse_rate

        racks, uplink = say["racks"], say["uplink"]
        if self.racks is None:
            if self.uplink is not None:
                sep = " " if say is _SPELLING["magic"] else ", "
                raise LabUsageError(f"{uplink[0]} joins racks to the spine: give {racks[0]} too, like "
                                    f"{racks[1]}{sep}{uplink[1]}")
            return
        checks.whole(racks[0], self.racks, minimum=2, example=racks[1])
        assert self.nodes is not None
        if self.racks > self.nodes:
            raise LabUsageError(
                f"{racks[0]} {self.racks} is more racks than nodes ({say['nodes'][0]} {self.nodes}): every rack "
                f"needs a node; use at most {self.nodes} racks, or more nodes"
            )
        if self.uplink is not None:
            parse_rate(self.uplink, uplink[0], uplink[1])

    @property
    def local(self) -> bool:
        """Whether every engine runs on this machine: the local launcher's always do; MPI's do unless
        the job spans hosts (``mpi_spans_hosts``), when they need the launcher's own engine command
        and a controller the other hosts reach. Every other launcher starts engines elsewhere."""
        if self.launcher == "mpi":
            return not mpi_spans_hosts(os.environ)
        return self.launcher == "local"

    def node_link(self) -> Link | None:
        """The ``cluster.links.Link`` between nodes, or None (no nodes, or not shaped)."""
        from ..cluster.links import Link

        return None if self.link is None else Link.parse(self.link, self.latency)

    def rack_uplink(self) -> Link | None:
        """The ``cluster.links.Link`` from each rack to the spine, or None (no racks, or not shaped)."""
        from ..cluster.links import Link, parse_rate

        return None if self.uplink is None else Link(parse_rate(self.uplink, "uplink", 'uplink="1gbit"'))

    def where(self) -> str:
        """Where the ranks run, as the start says it: "" on loopback, else the nodes, racks and links."""
        if not self.nodes:
            return ""
        racks = f" in {self.racks} racks (uplink {self.rack_uplink() or 'not shaped'})" if self.racks else ""
        return f" on {self.nodes} nodes (link {self.node_link() or 'not shaped'}){racks}"

    def ranks_per_node(self) -> list[int]:
        """How many ranks each node runs (``cluster.nodes.spread``)."""
        from ..cluster.nodes import spread

        return spread(self.ranks, self.nodes or 1)


def lab_config(config: LabConfig | None, *args: Any, **overrides: Any) -> LabConfig:
    """What a lab is built of (``Lab(...)``, ``distlab.start(...)``): ``config`` with ``overrides``
    (checked again), or a new configuration of the fields given (``ranks`` may come first)."""
    if config is None:
        return LabConfig(*args, **overrides)
    if args:
        raise TypeError("give a lab's configuration once: config=..., or its fields (ranks=2, ...), not both")
    return replace(config, **overrides) if overrides else config
