"""The private ipyparallel launcher APIs distlab's own launchers (``cluster/forked.py``,
``cluster/slurm.py``) use: following a process a launcher did not start, and the two steps of a
batch launcher that have no public hook.

``ipycompat.py``'s rule holds here: each private API is used in this module and nowhere else, with
what it does and why no public API does it. Importing this module imports ipyparallel (its
launchers are subclassed here) and checks its release (``ipycompat.KNOWN_GOOD``): outside it, or
where an attribute is gone, one line says what to install.
"""

from __future__ import annotations

from .ipycompat import checked_package, required_attribute

checked_package("ipyparallel")

from ipyparallel.cluster import launcher as _launchers  # noqa: E402 - after the release is checked

__all__ = ["SlurmLauncherHooks", "start_waiting"]


def start_waiting(launcher: object) -> None:
    """Make a ``LocalProcessLauncher`` follow the process whose pid it was given: a thread waits for
    its exit and calls the launcher's ``notify_stop``, as for a process it started itself.

    ``LocalProcessLauncher._start_waiting``: the launcher's ``start`` calls it once the process is
    up; a launcher that forks its process instead (``cluster/forked.py``) has no public way to ask.
    """
    required_attribute(launcher, "_start_waiting", "ipyparallel", "follow a forked process")()


_SLURM_HOOKS = ("_run_command", "_insert_job_array_in_script")


class SlurmLauncherHooks(_launchers.SlurmEngineSetLauncher):  # type: ignore[misc]  # ipyparallel is untyped
    """ipyparallel's ``SlurmEngineSetLauncher``, with two private steps opened as public methods for
    a subclass to override: :meth:`run_command` and :meth:`script_array_inserted`.

    ``BatchSystemLauncher._run_command``: the one call that runs ``sbatch``, ``scancel`` (and, for
    distlab, ``squeue``), without a deadline; ``SlurmEngineSetLauncher._insert_job_array_in_script``:
    the step after which the batch script's template has its task count and may take more
    ``#SBATCH`` lines. A subclass made of this checks, as it is made, that ipyparallel still has both.
    """

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for name in _SLURM_HOOKS:
            required_attribute(_launchers.SlurmEngineSetLauncher, name, "ipyparallel", "submit to Slurm")

    def run_command(self, command: list[str], **kwargs: object) -> str:
        """Run a Slurm command; its output (ipyparallel's own, by default)."""
        return str(super()._run_command(command, **kwargs))

    def script_array_inserted(self) -> None:
        """Called once the batch script's template has its task count (nothing, by default)."""

    def _run_command(self, command: list[str], **kwargs: object) -> str:
        return self.run_command(command, **kwargs)

    def _insert_job_array_in_script(self) -> None:
        super()._insert_job_array_in_script()
        self.script_array_inserted()
