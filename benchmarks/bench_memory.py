"""What a rank holds, measured against ``distlab.theory.sharded_memory``: DDP, ZeRO-1, FSDP2 (ZeRO-3-like,
ZeRO-2-like at the peak) and FSDP2 with bf16 all-gathers, on two gloo ranks of a real lab.

Each configuration trains the labs' GPT (distlab.nn, fp32, Adam) for a few steps under
``distlab.watch``; the table takes the last step's record: the parameter, gradient and optimizer-state
bytes the rank holds (local shards), the step's peak, and the bytes of its collectives. Theory is
``sharded_memory(P, strategy, 2, precision="fp32")``; each row gives measured / theory - 1.

    python benchmarks/bench_memory.py [--steps 3] [--layers 4] [--hidden 128]
"""

from __future__ import annotations

import argparse

import distlab
from distlab import theory

# Runs on every rank; LAYERS, HIDDEN and STEPS are pushed by the client.
_RANK_CODE = r"""
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from distlab.nn import GPT, GPTConfig, CharTokenizer, corpus, token_batches

_text = corpus()
_tok = CharTokenizer(_text)
_cfg = GPTConfig(vocab_size=_tok.vocab_size, seq_len=64, layers=LAYERS, hidden=HIDDEN, heads=4)
_batches = token_batches(_tok.encode(_text), batch_size=8, seq_len=64, rank=rank, world_size=world_size)

def _build(kind):
    torch.manual_seed(0)
    model = GPT(_cfg)
    if kind in ("ddp", "zero1"):
        model = DDP(model)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if kind == "fsdp2-bf16" else None)
        keep = kind == "fsdp2-keep"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=not keep, mp_policy=mp)
        fully_shard(model, reshard_after_forward=not keep, mp_policy=mp)
    if kind == "zero1":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt

def _run(kind):
    model, opt = _build(kind)
    watch = distlab.watch(model, stats_every=0, checksum_every=0, publish=False)
    for step in range(STEPS):
        x, y = _batches[step]
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
    watch.close()
    last = watch.records()[-1]
    bare = getattr(model, "module", model)
    unit = max(sum(p.numel() for p in b.parameters()) for b in bare.blocks)   # FSDP2's largest unit, a block
    ops = {}
    for c in last["collectives"]:
        n, b = ops.get(c["op"], (0, 0))
        ops[c["op"]] = (n + 1, b + c["bytes"])
    buckets = [b["bytes"] for b in last["allreduce"]]
    if buckets:
        ops["all_reduce"] = (len(buckets), sum(buckets))
    return {"memory": last["memory"], "collectives": ops, "unit": unit, "loss": loss.item()}

_P = sum(p.numel() for p in GPT(_cfg).parameters())
_results = {kind: _run(kind) for kind in ("ddp", "zero1", "fsdp2", "fsdp2-keep", "fsdp2-bf16")}
(_P, _results)
"""

# kind -> (theory strategy, reshard_after_forward, bytes of a gathered weight)
CONFIGS = {
    "ddp": ("ddp", True, 4),
    "zero1": ("zero1", True, 4),
    "fsdp2": ("fsdp2", True, 4),
    "fsdp2-keep": ("fsdp2", False, 4),
    "fsdp2-bf16": ("fsdp2", True, 2),
}


def _error(got: float, expected: float) -> str:
    return f"{100 * (got / expected - 1):+.2f}%" if expected else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    with distlab.start(ranks=2, timeout=120) as lab:
        lab.push(LAYERS=args.layers, HIDDEN=args.hidden, STEPS=args.steps)
        results = lab.run(_RANK_CODE, stream=False, timeout=600)
    params = results[0][0]
    unit = results[0][1]["ddp"]["unit"]
    print(f"GPT, {params:,} parameters (largest FSDP2 unit {unit:,}), fp32 Adam, 2 ranks, step {args.steps} of "
          f"{args.steps}; bytes on rank 0 / rank 1; theory: distlab.theory.sharded_memory(P, strategy, 2, "
          f'precision="fp32")\n')
    print("| config | part | rank 0 | rank 1 | theory | error (rank 0 / 1) |")
    print("|---|---|---|---|---|---|")
    for kind, (strategy, reshard, gathered_bytes) in CONFIGS.items():
        th = theory.sharded_memory(params, strategy, 2, precision="fp32", reshard_after_forward=reshard,
                                   largest_unit_parameters=unit)
        # bf16 gathers: the shards stay fp32, the gathered units are 2 bytes (the "mixed" layout's weights).
        gathered = theory.sharded_memory(params, strategy, 2, precision="fp32" if gathered_bytes == 4 else "mixed",
                                         reshard_after_forward=reshard, largest_unit_parameters=unit)
        expected = {"parameters_bytes": th.parameters_bytes, "gradients_bytes": th.gradients_bytes,
                    "optimizer_bytes": th.optimizer_bytes}
        for key, want in expected.items():
            got = [results[r][1][kind]["memory"][key] for r in (0, 1)]
            print(f"| {kind} | {key} | {got[0]:,} | {got[1]:,} | {want:,.0f} | "
                  f"{_error(got[0], want)} / {_error(got[1], want)} |")
        peaks = [results[r][1][kind]["memory"]["peak_bytes"] for r in (0, 1)]
        print(f"| {kind} | step peak (watch) | {peaks[0]:,} | {peaks[1]:,} | {th.total_bytes + gathered.peak_extra_bytes:,.0f} + activations | - |")
    print("\nCollectives of one step (rank 0; both ranks alike), bytes each rank sends (theory.collective_bytes)\n")
    print("| config | all-gathers | reduce-scatters | all-reduces | sent per rank | theory | error |")
    print("|---|---|---|---|---|---|---|")
    for kind, (strategy, reshard, gathered_bytes) in CONFIGS.items():
        ops = results[0][1][kind]["collectives"]
        if strategy == "fsdp2":
            want = theory.fsdp_bytes_per_step(gathered_bytes * params, 2, reshard_after_forward=reshard)
        else:
            want = theory.ddp_bytes_per_step(4 * params, 2)
        sent = sum(theory.collective_bytes(op, b, 2).sent_bytes for op, (_, b) in ops.items())
        cells = [f"{ops[op][0]} x {ops[op][1]:,} B" if op in ops else "-"
                 for op in ("all_gather", "reduce_scatter", "all_reduce")]
        print(f"| {kind} | {' | '.join(cells)} | {sent:,.0f} | {want:,.0f} | {_error(sent, want)} |")


if __name__ == "__main__":
    main()
