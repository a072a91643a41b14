"""An empty ``%%ddp`` cell against raw ipyparallel's ``%%px``, each through a real Jupyter kernel.

What a person waits for: from the notebook sending the cell (``execute_request``) to the kernel
going idle again, the reply in hand. Both magics run in one kernel on the same lab's engines
(``%%px`` on a DirectView of the lab's ranks, activated as ipyparallel's docs show), interleaved
cell by cell so that drift hits both alike. The history the kernel keeps grows as cells run: the
first and the last quarter of the calls are shown apart, to see the cost stay flat.

    python benchmarks/bench_kernel_roundtrip.py [--calls 200] [--ranks 2] [--first-output 20] [--profile]

It also times a cell that prints a line, then works for 0.2 s: from sending it to its first line
arriving, which is what a person sees first.

``--profile`` runs cProfile in the kernel around the ``%%ddp`` cells and prints where their time went.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from jupyter_client.manager import start_new_kernel

_SETUP_PX = """
from distlab.notebook import labs
# As ipyparallel's own Client.activate does: a blocking view (a fresh direct_view's block is
# False, and its %%px would return before the engines ran the cell).
_view = labs.current().processes.client.activate([row.engine_id for row in labs.current().table])
assert _view.block
"""


_WAIT_LOADED = """
import time
from distlab.dashboard import autoshow
# The background import ends with warming plotly's validators (seconds of a core after the
# modules are in sys.modules): wait for the thread's end, not for the modules.
assert autoshow._loaded.wait(240), "the dashboard's background import did not end"
time.sleep(0.5)
"""


def _execute(kc: Any, code: str, timeout: float, marker: str | None) -> tuple[float, str, float | None]:
    """Run ``code``: (seconds from sending it to the kernel's reply and its going idle, what it
    printed, seconds to the first output containing ``marker``); fails on an error."""
    t0 = time.perf_counter()
    msg_id = kc.execute(code)
    out, first = [], None
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        content = msg["content"]
        if msg["msg_type"] == "error":
            raise RuntimeError("\n".join(content["traceback"]))
        if msg["msg_type"] == "stream":
            out.append(content["text"])
        # %%ddp prints its ranks' lines (stream); %%px shows each engine's as a display it updates.
        text = content.get("text", "") if msg["msg_type"] == "stream" else content.get("data", {}).get("text/plain", "")
        if first is None and marker is not None and marker in text:
            first = time.perf_counter() - t0
        if msg["msg_type"] == "status" and content["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"{code!r}: {reply['content']}")
    return time.perf_counter() - t0, "".join(out), first


def _run(kc: Any, code: str, timeout: float = 120.0) -> tuple[float, str]:
    """(seconds from sending ``code`` to the kernel's reply and its going idle, what it printed)."""
    seconds, printed, _ = _execute(kc, code, timeout, None)
    return seconds, printed


def _first_output(kc: Any, code: str, timeout: float = 120.0) -> float:
    """Seconds from sending ``code`` to the first line any rank printed arriving from the kernel."""
    _, _, first = _execute(kc, code, timeout, "ready")
    assert first is not None, f"{code!r} printed nothing"
    return first


# A cell that prints at once, then works: what a person sees first is the print.
_PRINTS = "print('ready', flush=True)\nimport time\ntime.sleep(0.2)"


def _p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--first-output", type=int, default=20, help="cells timed to their first line of output")
    args = parser.parse_args()
    print("| ranks | `%%px` p50 (ms) | `%%ddp` p50 (ms) | ratio | `%%px` p90 | `%%ddp` p90 | "
          "`%%ddp` p50, first quarter | last quarter |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.ranks:
        km, kc = start_new_kernel(kernel_name="python3")
        try:
            _run(kc, f"%load_ext distlab\n%dist start -n {n}", timeout=300)
            _run(kc, _SETUP_PX)
            # A started lab loads the dashboard's modules in a background thread of the kernel; the
            # calls wait for it, as a person's first cells would not (they read the output first).
            _run(kc, _WAIT_LOADED, timeout=300)
            if args.profile:
                _run(kc, "import cProfile, pstats\n_prof = cProfile.Profile()")
            px, ddp = [], []
            warmup = 10
            for i in range(args.calls + warmup):
                a, _ = _run(kc, "%%px\npass")
                if args.profile:
                    _run(kc, "_prof.enable()")
                b, _ = _run(kc, "%%ddp\npass")
                if args.profile:
                    _run(kc, "_prof.disable()")
                if i >= warmup:
                    px.append(a)
                    ddp.append(b)
            firsts: dict[str, list[float]] = {"px": [], "ddp": []}
            for _ in range(args.first_output):
                firsts["px"].append(_first_output(kc, "%%px\n" + _PRINTS))
                firsts["ddp"].append(_first_output(kc, "%%ddp\n" + _PRINTS))
            q = max(2, len(ddp) // 4)
            first, last = statistics.median(ddp[:q]) * 1e3, statistics.median(ddp[-q:]) * 1e3
            a50, b50 = statistics.median(px) * 1e3, statistics.median(ddp) * 1e3
            print(f"| {n} | {a50:.1f} | {b50:.1f} | {b50 / a50:.2f}x | {_p(px, 90):.1f} | {_p(ddp, 90):.1f} | "
                  f"{first:.1f} | {last:.1f} |", flush=True)
            if args.first_output:
                print(f"  first line of output (a cell that prints, then sleeps 0.2 s), p50 of {args.first_output}: "
                      f"%%px {statistics.median(firsts['px']) * 1e3:.1f} ms, "
                      f"%%ddp {statistics.median(firsts['ddp']) * 1e3:.1f} ms", flush=True)
            if args.profile:
                print(_run(kc, "pstats.Stats(_prof).sort_stats('cumulative').print_stats(40)")[1])
                print(_run(kc, "pstats.Stats(_prof).sort_stats('tottime').print_stats(25)")[1])
                print(_run(kc, "pstats.Stats(_prof).print_callees('cells.py.*_run_on|cell.py.*_wait|lab.py.*_on_poll')")[1])
            _run(kc, "%dist stop", timeout=120)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)


if __name__ == "__main__":
    main()
