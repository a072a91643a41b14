"""ipyparallel's Slurm engine launcher, as a lab uses it: ``--launcher slurm``.

It is ipyparallel's own (one batch job, ``srun`` starting the engines; every ``c.SlurmLauncher`` and
``c.SlurmEngineSetLauncher`` setting of the profile applies), with what a lab needs besides:

- ``options`` reach the job: ipyparallel 9 declares ``SlurmLauncher.options`` ("Extra Slurm
  options", e.g. ``--gres=gpu:4 --ntasks-per-node=4``) but writes it nowhere; here it becomes an
  ``#SBATCH`` line of the default script (a ``batch_template`` of the user's own is left as written).
- The batch script is written to a folder of its own and removed once submitted, not left in the
  notebook's directory (where two labs started from one folder would write the same file).
- A submission that fails says why in one line: no ``sbatch`` here, or sbatch's own error.
- While the lab waits for the engines, ``squeue`` says what became of the job: one that Slurm will
  never start as asked (more ranks than the partition holds, a time limit over its limit, ...) or
  that ended before its engines registered stops the wait at once; one still pending at the
  deadline is named, with Slurm's reason, in the error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from traitlets import Float, List
from traitlets.config import Config

from ..errors import DistlabError, LabUsageError
from ..ipycompat_launchers import SlurmLauncherHooks

__all__ = ["SlurmEngineSetLauncher"]

# Pending reasons (squeue's %r) that waiting never clears: the job cannot run as submitted.
_NEVER = {
    "PartitionConfig": "its partition has too few nodes or CPUs for it",
    "PartitionNodeLimit": "it needs more nodes than its partition allows a job",
    "PartitionTimeLimit": "its time limit (c.SlurmLauncher.timelimit) is over its partition's",
    "BadConstraints": "no node has what it asks for (c.SlurmLauncher.options)",
    "InvalidAccount": "its account (c.SlurmLauncher.account) is not valid",
    "AccountNotAllowed": "its account may not use its partition",
    "InvalidQOS": "its QOS (c.SlurmLauncher.qos) is not valid",
    "QOSNotAllowed": "its QOS may not use its partition",
}
_WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"}
_RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT"}
# squeue asks slurmctld, which sites ask users not to poll hard: at most this often.
_QUERY_EVERY_S = 2.0


@dataclass(frozen=True)
class JobState:
    """What squeue says of a job: its state, why it waits (``None`` when it does not), its partition."""

    state: str
    reason: str
    partition: str


class SlurmEngineSetLauncher(SlurmLauncherHooks):
    """ipyparallel's ``SlurmEngineSetLauncher`` (configured by the same names), as the module says."""

    query_command = List(["squeue"], config=True, help="How the job's state is asked ['squeue']")
    command_timeout = Float(60.0, config=True, help="Seconds sbatch, scancel and squeue may take")

    def __init__(self, work_dir: str = ".", config: Config | None = None, **kwargs: object) -> None:
        super().__init__(work_dir=work_dir, config=config, **kwargs)
        self._script_dir: str | None = None
        self._state: JobState | None = None
        self._asked = float("-inf")

    # ------------------------------------------------------------------ submission

    def write_batch_script(self, n: int = 1) -> None:
        self._script_dir = tempfile.mkdtemp(prefix="distlab-sbatch-")
        self.batch_file = os.path.join(self._script_dir, self.batch_file_name)
        super().write_batch_script(n)

    def script_array_inserted(self) -> None:
        # The options go in after ipyparallel has looked for a task count of the user's own: its
        # pattern takes --ntasks-per-node or --nodes for one, and would leave out ``--ntasks={n}``.
        options = self.options.strip()
        if options:  # sbatch reads several options from one #SBATCH line, quoted as in a shell
            template: str = self.batch_template  # type: ignore[has-type]  # a trait mypy cannot type (.tag())
            first, rest = template.split("\n", 1)
            escaped = options.replace("{", "{{").replace("}", "}}")  # the template is formatted next
            self.batch_template = f"{first}\n#SBATCH {escaped}\n{rest}"

    def run_command(self, command: list[str], **kwargs: Any) -> str:
        """ipyparallel's, with a deadline, and sbatch's or scancel's error kept for the message."""
        self.log.debug("Running command: %s", " ".join(command))
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=self.command_timeout, check=False, **kwargs)
        if done.returncode:
            raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
        return str(done.stdout.decode("utf8", "replace"))

    def start(self, n: int = 1) -> str:
        try:
            return str(super().start(n))
        except FileNotFoundError:
            raise LabUsageError(
                f"the slurm launcher submits the engines with {self.submit_command[0]}, which is not on PATH here: "
                "start the lab where Slurm's commands run (a login node), or name yours in the ipyparallel profile "
                "(c.SlurmLauncher.submit_command)"
            ) from None
        except subprocess.CalledProcessError as exc:
            raise LabUsageError(
                f"Slurm refused the engines' job ({n} tasks): {_said(exc)}; change what it names in the "
                "ipyparallel profile (c.SlurmLauncher.queue, .timelimit, .account, .options) or ask for fewer ranks"
            ) from None
        except subprocess.TimeoutExpired:
            raise DistlabError(
                f"{self.submit_command[0]} did not answer within {self.command_timeout:g} s: is slurmctld up?"
            ) from None
        finally:
            if self._script_dir is not None:
                shutil.rmtree(self._script_dir, ignore_errors=True)  # sbatch keeps its own copy

    def stop(self) -> str:
        """Cancel the job; a job that never was (its submission failed) or that already ended is stopped too."""
        if not self.job_id:
            self.notify_stop({"job_id": "", "output": ""})
            return ""
        try:
            return str(super().stop())
        except (OSError, subprocess.SubprocessError) as exc:  # gone already, or Slurm unreachable
            self.log.warning("scancel %s: %s", self.job_id, exc)
            self.notify_stop({"job_id": self.job_id, "output": str(exc)})
            return ""

    # ------------------------------------------------------------------ the job, while engines are awaited

    def job_state(self) -> JobState | None:
        """What squeue says of the job now (asked at most every few seconds); None if it cannot say."""
        if not self.job_id:
            return None
        now = time.monotonic()
        if now - self._asked >= _QUERY_EVERY_S:
            self._asked = now
            try:
                said = self.run_command([*self.query_command, "--noheader", "--states=all", f"--jobs={self.job_id}",
                                          "--format=%T|%r|%P"])
            except (OSError, subprocess.SubprocessError):
                return self._state
            fields = said.strip().split("|")
            if len(fields) == 3:
                self._state = JobState(*fields)
        return self._state

    def check(self) -> None:
        """Raise, in one line, when the job will never bring its engines: ``LabUsageError`` when Slurm
        will not run it as asked, ``DistlabError`` when it has ended. Nothing while it runs or may start."""
        state = self.job_state()
        if state is None or state.state in _RUNNING:
            return
        if state.state in _WAITING:
            why = _NEVER.get(state.reason)
            if why is not None:
                raise LabUsageError(
                    f"Slurm will not start the engines' job {self.job_id} ({self.n} tasks, partition "
                    f"{state.partition}): {why} (squeue: {state.state}, {state.reason}); ask for fewer ranks, "
                    "or change the ipyparallel profile's Slurm settings"
                )
            return
        raise DistlabError(
            f"Slurm's job {self.job_id} of the engines ended ({state.state}) before they all registered; "
            f"its output: {self._output_gist()}"
        )

    def _output_gist(self) -> str:
        """The job's output in a line: its first error (the cause: srun's or a task's own, a Python
        exception) and its last line (srun's summary of the tasks)."""
        try:
            with open(self.output_file, errors="replace") as f:
                said = [line.strip()[:300] for line in f if line.strip()]
        except OSError:
            return "(none)"
        first = next((line for line in said if "error:" in line.lower()), None)
        if not said:
            return "(none)"
        return said[-1] if first in (None, said[-1]) else f"{first} [...] {said[-1]}"

    def report(self) -> str:
        """The job as the lab's start reports it when engines are missing."""
        state = self.job_state()
        if state is None:
            return f"\n  Slurm job {self.job_id or '(not submitted)'}"
        waits = f", waiting for {state.reason}" if state.state in _WAITING and state.reason != "None" else ""
        return f"\n  Slurm job {self.job_id}: {state.state}{waits} (partition {state.partition})"


def _said(exc: subprocess.CalledProcessError) -> str:
    """The error lines a Slurm command wrote, in one line ("sbatch: error: " left out); its last line
    of output if none says error."""
    text = (exc.stderr or b"").decode("utf8", "replace") + (exc.stdout or b"").decode("utf8", "replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line.split("error:", 1)[1].strip() for line in lines if "error:" in line]
    return "; ".join(errors) if errors else (lines or [f"exit status {exc.returncode}"])[-1]
