"""What live stacks cost: ``lab.stacks()`` of 1 and 4 ranks while a cell runs (Python frames, and
with the native ones), and what reading them adds to the stop of a cell that hangs.

- reading: each rank read by py-spy at once (one process per rank), while every rank sleeps in a
  cell; the times are ``lab.stacks()``'s, from the call to the folded result.
- a hang's stop: a cell in which rank 0 waits in an all-reduce that ranks 1-3 never reach, stopped
  at its 2 s deadline, from the call to the error; with the stacks read before the stop (what
  distlab does) and without (the baseline: ``_stacks_of_stopped`` made to read nothing),
  interleaved within each repeat.

    python benchmarks/bench_stacks.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import distlab
from distlab.errors import CellTimeout

SLEEP = "import time\ndef waiting_here():\n    time.sleep(SECONDS)\nwaiting_here()\n"
HANG = "import time\ndef stuck_here():\n    time.sleep(60)\nif rank != 0:\n    stuck_here()\ndist.all_reduce(torch.ones(1))\n"


def _hang_stops(lab: distlab.Lab, repeats: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {"with stacks": [], "without (baseline)": []}
    reads = lab.stacks_reader.of_stopped
    for _ in range(repeats):
        for name in seconds:
            lab.stacks_reader.of_stopped = reads if name == "with stacks" else (lambda ranks: "")  # type: ignore[method-assign]
            t0 = time.perf_counter()
            try:
                lab.run(HANG, timeout=2, stream=False)
            except CellTimeout as exc:
                assert ("stuck_here" in str(exc)) == (name == "with stacks"), str(exc)
            seconds[name].append(time.perf_counter() - t0)
    lab.stacks_reader.of_stopped = reads  # type: ignore[method-assign]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with distlab.start(ranks=4) as lab:
        lab.run("x = 1", stream=False)
        stops = _hang_stops(lab, args.repeats)
        print("| a hang's stop (4 ranks, 2 s deadline) | median | min-max |")
        print("|---|---|---|")
        for name, values in stops.items():
            print(f"| {name} | {statistics.median(values):.2f} s | {min(values):.2f}-{max(values):.2f} s |")
        lab.stop()
    print()
    with distlab.start(ranks=4) as lab:
        reading = _reading_while_sleeping(lab, args.repeats)
        print("| lab.stacks() while a cell runs | median | min-max |")
        print("|---|---|---|")
        for name, values in reading.items():
            print(f"| {name} | {statistics.median(values) * 1e3:.0f} ms | "
                  f"{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f} ms |")


def _reading_while_sleeping(lab: distlab.Lab, repeats: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {"1 rank": [], "4 ranks": [], "4 ranks, native": []}
    result: dict[str, dict[str, list[float]]] = {}

    def read() -> None:
        time.sleep(3.0)  # every rank in the cell
        for _ in range(repeats):
            for name, kwargs in (("1 rank", {"ranks": 0}), ("4 ranks", {}), ("4 ranks, native", {"native": True})):
                taken = lab.stacks(**kwargs)
                assert "waiting_here" in taken.text(), taken.text()
                seconds[name].append(taken.seconds)
        result["done"] = seconds

    reader = threading.Thread(target=read)
    reader.start()
    lab.run(SLEEP.replace("SECONDS", str(3 + repeats * 4)), stream=False)
    reader.join(120)
    return result["done"]


if __name__ == "__main__":
    main()
