"""A/B of the DDP comm hook alone: two never-hooked copies of a 4.2M-parameter MLP and one whose
distlab.watch was closed (its hook stays, switched off), 2 gloo ranks, 40 rotating rounds of 10 steps.
The two never-hooked copies give the noise floor.

    python benchmarks/bench_hook_ab.py
"""
import statistics, distlab
CODE = r'''
import time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
def _make():
    torch.manual_seed(0); w = 1024
    return torch.nn.Sequential(torch.nn.Linear(w, 2*w), torch.nn.ReLU(), torch.nn.Linear(2*w, w), torch.nn.ReLU(), torch.nn.Linear(w, 10))
_x = torch.randn(64, 1024); _y = torch.randint(0, 10, (64,))
_c = {n: DDP(_make()) for n in ("plain", "closed", "plain2")}
_o = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in _c.items()}
distlab.watch(_c["closed"]).close()
def _chunk(n, steps=10):
    m, o = _c[n], _o[n]; t0 = time.perf_counter()
    for _ in range(steps):
        o.zero_grad(); torch.nn.functional.cross_entropy(m(_x), _y).backward(); o.step()
    return time.perf_counter() - t0
for n in _c: _chunk(n, 3)
_t = {n: [] for n in _c}; order = list(_c)
for r in range(40):
    order = order[1:] + order[:1]
    for n in order: _t[n].append(_chunk(n))
_t
'''
with distlab.start(ranks=2) as lab:
    t = lab.run(CODE, stream=False, timeout=900)[0]
    for n in ("closed", "plain2"):
        print(n, "/ plain:", f"{100*statistics.median(a/b for a, b in zip(t['plain'], t[n])):.1f}%")
