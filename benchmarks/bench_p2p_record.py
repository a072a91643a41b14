"""What recording every send and receive costs (the hang diagnosis of point-to-point operations).

Two ranks ping-pong a tensor with ``dist.send`` / ``dist.recv`` (rank 0 sends, rank 1 sends it back)
as a pipeline's stages pass activations, with the record on (what distlab does: each send and
receive passes through ``flight._posted``) and off (the baseline: the process group's own methods
put back for the round), interleaved, one round of ``--trips`` round trips each, ``--repeats``
rounds. Reported: microseconds per round trip, for a small tensor (4 floats) and a 1 MiB one.

    python benchmarks/bench_p2p_record.py [--repeats 7] [--trips 500]
"""

from __future__ import annotations

import argparse
import statistics

import distlab

ROUND = """
import time
import torch.distributed as dist
PG = dist.ProcessGroup
_methods = ("send", "recv", "recv_anysource")
_observed = {name: getattr(PG, name) for name in _methods}

def _round(recorded, trips, numel):
    for name in _methods:  # the baseline: torch's own methods, as before distlab observed them
        setattr(PG, name, _observed[name] if recorded else _observed[name].__wrapped__)
    t = torch.zeros(numel)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(trips):
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
    seconds = time.perf_counter() - t0
    for name in _methods:
        setattr(PG, name, _observed[name])
    return seconds / trips * 1e6
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--trips", type=int, default=500)
    args = parser.parse_args()
    sizes = {"4 floats": 4, "1 MiB": 262144}
    with distlab.start(ranks=2) as lab:
        lab.run(ROUND, stream=False)
        results: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for size, numel in sizes.items():
                for name, recorded in (("recorded (distlab)", True), ("not recorded (baseline)", False)):
                    got = lab.run(f"_round({recorded}, {args.trips}, {numel})", stream=False)
                    results.setdefault((size, name), []).append(got[0])
    print(f"| ping-pong, 2 ranks, gloo | us per round trip, median | min-max |  ({args.repeats} rounds of {args.trips})")
    print("|---|---|---|")
    for (size, name), values in results.items():
        print(f"| {size}, {name} | {statistics.median(values):.1f} | {min(values):.1f}-{max(values):.1f} |")


if __name__ == "__main__":
    main()
