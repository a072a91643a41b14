"""What a class's hub costs a learner: a lab in a learner's server against one in a plain kernel.

Run as root (the hub starts each learner's server as that learner; the learners are system users
made for the run and removed after it, as tests/test_classroom_hub.py does, with whose helpers,
``tests/_hub.py``, this script builds the hub):

    .venv/bin/python benchmarks/bench_classroom.py [--repeats 3] [--learners 3]

Interleaved, ``--repeats`` rounds of: a 2-rank lab started in a plain kernel of this machine (the
baseline: root's, on the machine's loopback, no control group), then the same in a learner's
kernel (their user, their network namespace, their control group, no cores limit), each timed
for ``%dist start -n 2`` and for a %%ddp loop of 1 MiB all-reduces (the ranks' loopback). Then
every learner starts a 2-rank lab at the same moment. Also: a learner's server, from the hub's
spawn request to ready; and the all-reduce loop again with the learner held to 1 core.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _hub import Hub, LearnerKernel

START = "%load_ext distlab\n%dist start -n 2"
LOOP = ("%%ddp\nimport time\nx = torch.ones(262144)\nfor _ in range(5): dist.all_reduce(x)\n"
        "t = time.perf_counter()\nfor _ in range(100): dist.all_reduce(x)\n"
        "if rank == 0: print('allreduce_ms', (time.perf_counter() - t) * 10)")
STOP = "%dist stop"


def _allreduce_ms(out: str) -> float:
    found = re.search(r"allreduce_ms ([\d.]+)", out)
    assert found, out
    return float(found.group(1))


class PlainKernel:
    """A kernel of this machine's own (root's), driven as the learner's is."""

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3")

    def run(self, code: str, timeout: float = 300) -> str:
        out: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        assert reply["content"]["status"] == "ok", "".join(out)
        return "".join(out)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)


def _round(kernel: Any) -> tuple[float, float]:
    t0 = time.perf_counter()
    kernel.run(START)
    started = time.perf_counter() - t0
    ms = _allreduce_ms(kernel.run(LOOP))
    kernel.run(STOP)
    return started, ms


def _row(name: str, values: list[float], unit: str) -> str:
    return f"| {name} | {statistics.median(values):.2f} {unit} ({min(values):.2f}-{max(values):.2f}) |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--learners", type=int, default=3)
    args = parser.parse_args()
    names = [f"dlb-{i}" for i in range(args.learners)]
    folder = Path(tempfile.mkdtemp(prefix="bench-classroom-"))
    rows: dict[str, list[float]] = {k: [] for k in ("plain start", "plain ms", "learner start", "learner ms",
                                                   "spawn", "together", "1 core ms")}
    with Hub(folder, names, [], limits="") as hub:
        tokens = {}
        for name in names:
            t0 = time.perf_counter()
            hub.start_server(name)
            rows["spawn"].append(time.perf_counter() - t0)
            tokens[name] = hub.user_token(name)
        plain = PlainKernel()
        learner = LearnerKernel(hub, names[0], tokens[names[0]])
        try:
            for _ in range(args.repeats):
                for kind, kernel in (("plain", plain), ("learner", learner)):
                    started, ms = _round(kernel)
                    rows[f"{kind} start"].append(started)
                    rows[f"{kind} ms"].append(ms)
        finally:
            plain.close()
        # Every learner at once: the slowest of their starts.
        kernels = [LearnerKernel(hub, name, tokens[name], "together.ipynb") for name in names]
        for _ in range(args.repeats):
            took: list[float] = []
            go = threading.Barrier(len(kernels))

            def start(kernel: LearnerKernel, go: threading.Barrier = go, took: list[float] = took) -> None:
                go.wait()
                t0 = time.perf_counter()
                kernel.run(START)
                took.append(time.perf_counter() - t0)

            threads = [threading.Thread(target=start, args=(k,)) for k in kernels]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rows["together"].append(max(took))
            for kernel in kernels:
                kernel.run(STOP)
        # The same learner held to 1 core (the control group a --cores 1 class gives them).
        group = next(Path("/sys/fs/cgroup/cpu").glob(f"distlab-{hub.process.pid}-{names[0]}"), None)
        if group is not None:
            (group / "cpu.cfs_quota_us").write_text("100000")
            for _ in range(args.repeats):
                rows["1 core ms"].append(_round(learner)[1])
    print(f"| what ({args.repeats} rounds, interleaved) | median (min-max) |")
    print("|---|---|")
    print(_row("learner's server: spawn request to ready", rows["spawn"], "s"))
    print(_row("`%dist start -n 2`, plain kernel (baseline)", rows["plain start"], "s"))
    print(_row("`%dist start -n 2`, a learner's kernel", rows["learner start"], "s"))
    print(_row(f"`%dist start -n 2`, {args.learners} learners at once (the slowest)", rows["together"], "s"))
    print(_row("1 MiB all-reduce, plain kernel's ranks (baseline)", rows["plain ms"], "ms"))
    print(_row("1 MiB all-reduce, a learner's ranks", rows["learner ms"], "ms"))
    if rows["1 core ms"]:
        print(_row("1 MiB all-reduce, a learner's ranks held to 1 core", rows["1 core ms"], "ms"))


if __name__ == "__main__":
    main()
