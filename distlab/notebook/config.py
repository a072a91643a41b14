"""A lab's configuration: one frozen dataclass, checked once, made alike by ``distlab.start`` and ``%dist start``."""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from importlib.metadata import entry_points

from .. import checks
from ..errors import LabUsageError

__all__ = ["BACKENDS", "LabConfig", "launcher_names"]

BACKENDS = ("auto", "gloo", "nccl")

# How each field is written, and an example of it, in Python and in the magics: a message names
# the value the way the user wrote it.
_SPELLING = {
    "python": {"ranks": ("ranks", "ranks=2"), "timeout": ("timeout", "timeout=30"), "debug": ("debug", "debug=True")},
    "magic": {"ranks": ("-n", "-n 2"), "timeout": ("--timeout", "--timeout 30"), "debug": ("--debug", "--debug")},
}


_SECONDS = "a number of seconds"


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
    #: "magic" when the values come from ``%dist``: messages then name its flags.
    spelling: InitVar[str] = "python"

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

    @property
    def local(self) -> bool:
        """Whether every engine runs on this machine."""
        return self.launcher in ("local", "mpi")
