"""Faults a healing lab outlives, timed: torchft's lighthouse killed mid-training, and a rank that
stalls past the lighthouse's join timeout. Against the baseline measured in the same run: the same
cell with no fault.

    python benchmarks/bench_heal_faults.py [--repeats 3] [--ranks 3] [--steps 300] [--at 20] [--stall-s 15]

Each rank trains a small MLP, one step every ~``STEP_S`` (a sleep stands in for compute), keeping
(healed step, wall time) for every loop iteration; ``distlab.chaos`` schedules the fault at step ``--at``.

- lighthouse: rank 0 SIGKILLs it after step ``--at``. Columns: the lab's restart of it (death to
  listening again, from the cell's note), the survivors' longest pause between two committed steps
  (torchft's quorum timeout, 30 s, is the bound), the loop iterations that did not commit.
- stall: rank 1 sleeps ``--stall-s`` before step ``--at``. Columns: the others' longest pause (the
  lighthouse's join timeout, 10 s, is the bound), the steps rank 1 missed, and from its return to its
  first committed step (its heal forward).
- none: the same cell with no fault; its longest pause is the machine's noise.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import textwrap
import time

import distlab

STEP_S = 0.03

TRAIN = textwrap.dedent(
    """
    import time
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model, opt = distlab.heal(model, torch.optim.SGD(model.parameters(), lr=0.01))
    FAULT
    manager = distlab.rank.heal.current().manager
    seen = []
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        opt.step()
        seen.append((manager.current_step(), time.time()))
        time.sleep(STEP_S)
    """
)

FAULTS = {
    "none": "",
    "lighthouse": "distlab.chaos(lighthouse=AT)",
    "stall": "distlab.chaos(stall={1: (AT, STALL)})",
}


def _longest_pause(seen: list[tuple[int, float]]) -> float:
    """The longest time between two committed steps (a step that did not commit is waited through)."""
    commits = [t for (step, t), (before, _) in zip(seen[1:], seen[:-1], strict=True) if step > before]
    return max((b - a for a, b in itertools.pairwise(commits)), default=0.0)


def run_once(lab: distlab.Lab, fault: str, steps: int, at: int, stall_s: float) -> dict[str, float]:
    code = (
        TRAIN.replace("FAULT", FAULTS[fault].replace("AT", str(at)).replace("STALL", repr(stall_s)))
        .replace("STEPS", str(steps)).replace("STEP_S", repr(STEP_S))
    )
    t0 = time.perf_counter()
    ran = lab.run(code, stream=False, timeout=300)
    row: dict[str, float] = {"cell_s": time.perf_counter() - t0}
    seen = lab.pull("seen")
    survivor = seen[0]
    row["pause_s"] = _longest_pause(survivor)
    row["not_committed"] = sum(1 for (s, _), (b, _) in zip(survivor[1:], survivor[:-1], strict=True) if s == b)
    if fault == "lighthouse":
        (note,) = [n for n in ran.notes if "lighthouse died" in n]
        row["restart_s"] = float(re.search(r"in ([\d.]+) s", note).group(1))  # type: ignore[union-attr]
    if fault == "stall":
        record = lab.heals()
        assert record is not None
        row["missed_steps"] = len(record.skipped.get(1, []))
        mine = seen[1]
        back = next(i for i in range(1, len(mine)) if mine[i][1] - mine[i - 1][1] > stall_s / 2)
        row["back_to_healed_s"] = mine[back][1] - (mine[back - 1][1] + stall_s)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--at", type=int, default=20)
    parser.add_argument("--stall-s", type=float, default=15.0)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {fault: [] for fault in FAULTS}
    lab = distlab.Lab(ranks=args.ranks, heal=True, timeout=300).start()
    try:
        for _ in range(args.repeats):
            for fault in FAULTS:  # interleaved: the rows share the machine's load
                rows[fault].append(run_once(lab, fault, args.steps, args.at, args.stall_s))
    finally:
        lab.stop()
    print(f"{args.ranks} ranks, {args.steps} steps of ~{STEP_S * 1000:.0f} ms, fault at step {args.at}; "
          f"medians of {args.repeats}")
    columns = ["cell_s", "pause_s", "not_committed", "restart_s", "missed_steps", "back_to_healed_s"]
    print("| fault | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for fault, runs in rows.items():
        cells = []
        for column in columns:
            values = [r[column] for r in runs if column in r]
            cells.append(f"{statistics.median(values):.2f}" if values else "-")
        print(f"| {fault} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
