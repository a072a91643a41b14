"""Emulated nodes in a user namespace (no root needed) against root's named namespaces.

For each kind, interleaved, ``--repeats`` rounds: the time to make and remove a 2-node network, and
the rate of one TCP stream of ``--mib`` MiB from node 0 to node 1 across a link shaped to 100 Mbit/s,
1 Gbit/s, and not shaped (the machine's own copying). Medians, with min-max. Run as root (both kinds
need it here: the named ones by definition; a user namespace would do without, see
tests/test_nodes_without_root.py).

    python benchmarks/bench_userns.py [--repeats 5] [--mib 24]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from distlab.cluster.namespaces import USERNS_ENV
from distlab.cluster.nodes import Link, Network

SINK = ("import socket\ns = socket.create_server(('', 9000))\nc, _ = s.accept()\nn = 0\n"
        "while (b := c.recv(1 << 20)):\n    n += len(b)\nprint(n)")
SEND = ("import socket, time\n"
        "for _ in range(200):\n    try:\n        s = socket.create_connection((%r, 9000)); break\n"
        "    except OSError: time.sleep(0.02)\n"
        "t = time.perf_counter(); s.sendall(bytes(%d)); s.shutdown(socket.SHUT_WR); s.recv(1)\n"
        "print(time.perf_counter() - t)")
LINKS = ("100mbit", "1gbit", None)


def _kind(userns: bool) -> None:
    if userns:
        os.environ[USERNS_ENV] = "1"
    else:
        os.environ.pop(USERNS_ENV, None)


def make_remove(userns: bool) -> float:
    _kind(userns)
    t0 = time.perf_counter()
    Network.create(nodes=2, link=Link.parse("1gbit")).destroy()
    return time.perf_counter() - t0


def stream_mbit(userns: bool, link: str | None, size: int) -> float:
    _kind(userns)
    net = Network.create(nodes=2, link=Link.parse(link) if link else None)
    try:
        sink = subprocess.Popen([*net.exec_prefix(1), sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
        took = float(subprocess.run([*net.exec_prefix(0), sys.executable, "-c", SEND % (net.node_addr(1), size)],
                                    capture_output=True, text=True, timeout=120, check=True).stdout)
        sink.communicate(timeout=60)
        return size * 8 / took / 1e6
    finally:
        net.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=24)
    args = parser.parse_args()
    size = args.mib << 20
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for userns in (False, True):
            kind = "user namespace" if userns else "named (root)"
            results.setdefault((kind, "make + remove, s"), []).append(make_remove(userns))
            for link in LINKS:
                results.setdefault((kind, f"{link or 'not shaped'}, Mbit/s"), []).append(stream_mbit(userns, link, size))
    print(f"{args.repeats} rounds, {args.mib} MiB per stream; median (min-max)\n")
    print(f"| measure | {' | '.join(k for k in ('named (root)', 'user namespace'))} |")
    print("|---|---|---|")
    for what in dict.fromkeys(w for _, w in results):
        cells = []
        for kind in ("named (root)", "user namespace"):
            v = results[kind, what]
            cells.append(f"{statistics.median(v):.3g} ({min(v):.3g}-{max(v):.3g})")
        print(f"| {what} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
