"""``scale.dry_run(plan)``: the plan's real torch code, run in its own process (the notebook never
imports torch), ``python -m distlab.rank.dryrun`` with the plan as JSON on stdin and the report on stdout."""

from __future__ import annotations

import json
import subprocess
import sys

from .. import checks
from .plan import Plan
from .report import DryRunReport

__all__ = ["dry_run"]


def dry_run(plan: Plan, timeout: float = 300) -> DryRunReport:
    """Run ``plan``'s step for one rank of each kind under torch's fake process group and FakeTensor
    (``distlab.rank.dryrun`` says what is measured and what derived). One line if it cannot: the
    dry run's own error line."""
    checks.instance("plan", plan, Plan, what="a scale.Plan", error=TypeError)
    seconds = checks.positive("timeout", timeout, example="timeout=300", kind="a number of seconds")
    try:
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-m", "distlab.rank.dryrun"], input=json.dumps(plan.to_json()),
            capture_output=True, text=True, timeout=seconds, check=False,
        )
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the dry run took longer than timeout={timeout} s: give it more (scale.dry_run(plan, "
                           "timeout=600)) or fewer layers") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if line.startswith("dry run failed")), lines[-1] if lines else "")
        raise RuntimeError(last or f"the dry run exited with status {done.returncode} and said nothing")
    return DryRunReport.from_json(plan, json.loads(done.stdout))
