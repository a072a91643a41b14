"""Healing, timed: a rank dies mid-training in a lab started with ``heal=True``; the survivors go on,
a replacement heals from a live peer, the cell ends on every rank. Against the baseline measured in
the same run: the same training in a lab that restarts from its last checkpoint.

    python benchmarks/bench_heal.py [--repeats 3] [--ranks 3] [--steps 150] [--dies-at 40] [--every 10]
                                    [--nodes N] [--cold]

``--nodes N``: every lab on N emulated nodes (root), the replacement started on the dead rank's node.
``--cold``: a third column, the same heal with every engine started cold (``DISTLAB_WARM=0``), as a
replacement on a node started before warm ranks reached the nodes.

Each rank trains a small MLP, one step every ~``STEP_S`` (a sleep stands in for compute), keeping
(healed step, wall time) for every committed step. Rank 1 SIGKILLs itself after committing step
``--dies-at``, having written the time.

- kill -> survivors' next commit: from the death to the first step a survivor committed after it
  (the lighthouse drops the dead after its 1 s heartbeat timeout; target <= 1.5 s).
- death -> replacement healed: from the death to the replacement's first committed step (fork,
  registration, the cell from its top, a quorum that sends it the others' state; target <= 2 s).
- steps/s before (the ``--dies-at`` steps before the death), during (death to healed) and after.
- lost work: the survivors' loop steps that did not commit, in steps and seconds; the baseline's
  steps since its last checkpoint plus the restart, next to ``theory.lost_work_s``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time

import distlab
from distlab import RankError
from distlab.theory.scaling import lost_work_s

STEP_S = 0.02

TRAIN = textwrap.dedent(
    """
    import os, signal, time
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = distlab.heal(model, opt)
    manager = distlab.rank.heal.current().manager
    committed = []
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.randn(32, 64, generator=g)).square().mean().backward()
        opt.step()
        committed.append((manager.current_step(), time.time()))
        if rank == 1 and manager.current_step() == DIES_AT and not os.path.exists(DEATH_FILE):
            with open(DEATH_FILE, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(STEP_S)
    """
)

# The baseline: plain DDP on the lab's group, a checkpoint every EVERY steps; rank 1 dies at DIES_AT.
BASELINE = textwrap.dedent(
    """
    import os, signal, time
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists(CKPT):
        state = torch.load(CKPT)
        model.module.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(start, STEPS):
        opt.zero_grad()
        model(torch.randn(32, 64, generator=g)).square().mean().backward()
        opt.step()
        if (step + 1) % EVERY == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, CKPT + ".tmp")
            os.replace(CKPT + ".tmp", CKPT)
        if rank == 1 and step + 1 == DIES_AT and not os.path.exists(DEATH_FILE):
            with open(DEATH_FILE, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(STEP_S)
    """
)


def _fill(code: str, **values: object) -> str:
    for name, value in values.items():
        code = code.replace(name, repr(value) if isinstance(value, str) else str(value))
    return code


def heal_once(ranks: int, steps: int, dies_at: int, nodes: int | None = None, cold: bool = False) -> dict[str, float]:
    os.environ["DISTLAB_WARM"] = "0" if cold else "1"  # read at each lab's start
    with tempfile.TemporaryDirectory() as tmp, distlab.start(ranks=ranks, heal=True, nodes=nodes) as lab:
        death = os.path.join(tmp, "died")
        t0 = time.time()
        lab.run(_fill(TRAIN, STEPS=steps, DIES_AT=dies_at, DEATH_FILE=death, STEP_S=STEP_S), stream=False)
        cell_s = time.time() - t0
        with open(death) as f:
            died = float(f.read())
        kept = lab.run("committed", stream=False)
        weights = lab.run(
            "import hashlib; hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()",
            stream=False,
        )
    survivor = kept[0]
    times = [t for _, t in survivor]
    after = [t for s, t in survivor if s > dies_at]  # committed without the dead rank
    healed_at = kept[1][0][1]
    before = [t for t in times if t <= died]
    lost_steps = steps - survivor[-1][0]
    window = [t for t in times if died < t <= healed_at]
    later = [t for t in times if t > healed_at]
    return {
        "next_commit_s": after[0] - died,
        "healed_s": healed_at - died,
        "before_sps": (len(before) - 1) / (before[-1] - before[0]),
        "during_sps": len(window) / max(1e-9, healed_at - died),
        "after_sps": (len(later) - 1) / (later[-1] - later[0]) if len(later) > 1 else float("nan"),
        "lost_steps": lost_steps,
        "cell_s": cell_s,
        "identical": float(len(set(weights.values())) == 1),
    }


def restart_once(ranks: int, steps: int, dies_at: int, every: int, nodes: int | None = None) -> dict[str, float]:
    os.environ["DISTLAB_WARM"] = "1"
    with tempfile.TemporaryDirectory() as tmp, distlab.start(ranks=ranks, nodes=nodes) as lab:
        death, ckpt = os.path.join(tmp, "died"), os.path.join(tmp, "ckpt.pt")
        code = _fill(BASELINE, STEPS=steps, DIES_AT=dies_at, DEATH_FILE=death, CKPT=ckpt, EVERY=every, STEP_S=STEP_S)
        t0 = time.time()
        try:
            lab.run(code, stream=False)
        except RankError:
            pass
        with open(death) as f:
            died = float(f.read())
        lab.restart()
        back = time.time()
        lab.run(code, stream=False)  # resumes from the checkpoint
        cell_s = time.time() - t0
    redone = dies_at % every
    return {"restart_s": back - died, "lost_steps": redone, "cell_s": cell_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dies-at", type=int, default=40)
    parser.add_argument("--every", type=int, default=25, help="the baseline's checkpoint interval, in steps")
    parser.add_argument("--nodes", type=int, default=0, help="emulated nodes for every lab (0: none)")
    parser.add_argument("--cold", action="store_true", help="also heal with every engine started cold")
    args = parser.parse_args()
    nodes = args.nodes or None
    heals, colds, restarts = [], [], []
    for i in range(args.repeats):  # interleaved
        heals.append(heal_once(args.ranks, args.steps, args.dies_at, nodes))
        if args.cold:
            colds.append(heal_once(args.ranks, args.steps, args.dies_at, nodes, cold=True))
        restarts.append(restart_once(args.ranks, args.steps, args.dies_at, args.every, nodes))
        print(f"run {i}: heal {heals[-1]}  cold {colds[-1:]}  restart {restarts[-1]}", file=sys.stderr, flush=True)

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    step_s = 1 / med(heals, "before_sps")
    where = f" on {args.nodes} nodes" if args.nodes else ""
    print(f"{args.ranks} ranks{where}, {args.steps} steps, rank 1 dies after step {args.dies_at}; medians of {args.repeats}\n")
    print("| | heal (torchft quorum) | restart from checkpoint (baseline) |" + (" heal, cold engines |" if colds else ""))
    print("|---|---|---|" + ("---|" if colds else ""))

    def cold(key: str) -> str:
        return f" {med(colds, key):.2f} |" if colds else ""

    print(f"| death -> survivors' next committed step (s) | {med(heals, 'next_commit_s'):.2f} | - (every rank stops) |"
          + cold("next_commit_s"))
    print(f"| death -> a whole world training again (s) | {med(heals, 'healed_s'):.2f} "
          f"| {med(restarts, 'restart_s'):.2f} (+ the steps redone) |" + cold("healed_s"))
    print(f"| steps/s before / during / after | {med(heals, 'before_sps'):.1f} / {med(heals, 'during_sps'):.1f} / "
          f"{med(heals, 'after_sps'):.1f} | - |")
    print(f"| steps lost | {med(heals, 'lost_steps'):.0f} | {med(restarts, 'lost_steps'):.0f} "
          f"(theory.lost_work_s: {lost_work_s(args.dies_at * step_s, args.every * step_s) / step_s:.0f} steps) |")
    print(f"| the whole cell, death included (s) | {med(heals, 'cell_s'):.2f} | {med(restarts, 'cell_s'):.2f} |")
    print(f"| every replica's weights bit-identical after | {all(h['identical'] for h in heals)} | - |")


if __name__ == "__main__":
    main()
