"""Grader of ``ddp-comm-hook``: the learner's hook averages each bucket as DDP's default does.

Each case builds the same model twice on every rank (one seed): one wrapped in DDP as it comes, one
in DDP with the learner's hook registered, both with the case's small ``bucket_cap_mb`` so that there
are several buckets. Each rank feeds both its own batch; after backward every gradient of the hooked
model must equal the default's (within float rounding), and the hook must have been called once
for each bucket the default DDP all-reduced.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TypedDict, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ...rank.exercise import Learner, backward, failed, first_difference, passed

_CLOSE = {"rtol": 1e-5, "atol": 1e-7}


class Case(TypedDict):
    name: str
    width: int
    layers: int
    cap_mb: float
    batch: int
    seed: int


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    out: list[Case] = []
    for layers, cap_mb in ((2, 25.0), (4, 0.01), (6, 0.004)):
        width = rng.randrange(24, 48)
        batch = rng.randrange(2, 9)
        out.append({"name": f"{layers} layers {width} wide, bucket_cap_mb {cap_mb:g}, batch {batch}",
                    "width": width, "layers": layers, "cap_mb": cap_mb, "batch": batch,
                    "seed": rng.randrange(2**31)})
    return out


def _model(case: Case) -> nn.Module:
    torch.manual_seed(case["seed"])
    w = case["width"]
    layers: list[nn.Module] = [nn.Linear(6, w), nn.Tanh()]
    for _ in range(case["layers"] - 2):
        layers += [nn.Linear(w, w), nn.Tanh()]
    layers.append(nn.Linear(w, 3))
    return nn.Sequential(*layers)


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    world = dist.get_world_size()
    default_buckets: list[int] = []
    hooked_buckets: list[int] = []

    def counting_default(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        default_buckets.append(bucket.index())
        world_group = cast(dist.ProcessGroup, dist.group.WORLD)  # set: the grader's ranks are in a group
        return default_hooks.allreduce_hook(world_group, bucket)  # DDP's own default, counted

    def counting_learners(state: object, bucket: dist.GradBucket) -> object:
        hooked_buckets.append(bucket.index())
        return learner["mean_hook"](state, bucket)

    # DDP reads a hook's annotations and refuses any that is not the very class; this module's are
    # strings (postponed evaluation), so the hooks go to DDP without them.
    counting_default.__annotations__.clear()
    counting_learners.__annotations__.clear()
    reference = DDP(_model(case), bucket_cap_mb=case["cap_mb"])
    reference.register_comm_hook(None, counting_default)
    hooked = DDP(_model(case), bucket_cap_mb=case["cap_mb"])
    hooked.register_comm_hook(None, counting_learners)
    local = _model(case)
    gen = torch.Generator().manual_seed(case["seed"] + 1 + dist.get_rank())
    # Two backward passes: DDP's first puts small models in one bucket (its first bucket's cap is 1 MiB);
    # after it, DDP rebuilds its buckets at bucket_cap_mb, in the order the gradients arrived.
    for iteration in (1, 2):
        for model in (local, reference, hooked):
            model.zero_grad(set_to_none=True)
        default_buckets.clear()
        hooked_buckets.clear()
        x, y = torch.randn(case["batch"], 6, generator=gen), torch.randn(case["batch"], 3, generator=gen)
        backward(nn.functional.mse_loss(local(x), y))
        backward(nn.functional.mse_loss(reference(x), y))
        try:
            backward(nn.functional.mse_loss(hooked(x), y))
        except RuntimeError as e:
            if "uture" in str(e):
                return failed(f"DDP could not use what mean_hook returned ({str(e).splitlines()[0][:160]}): "
                              "return a torch.futures.Future of the averaged tensor")
            raise
        if sorted(hooked_buckets) != sorted(default_buckets):
            return failed(f"backward {iteration}: mean_hook was called for buckets {hooked_buckets}, DDP has "
                          f"buckets {default_buckets}")
        for (name, p), q, own in zip(hooked.module.named_parameters(), reference.module.parameters(),
                                     local.parameters()):
            assert q.grad is not None and own.grad is not None  # every parameter here takes part in the loss
            wrong = first_difference(p.grad, q.grad, **_CLOSE)
            if wrong is None:
                continue
            if first_difference(p.grad, q.grad * world, **_CLOSE) is None:
                return failed(f"backward {iteration}: `{name}`'s gradient is {world} times DDP's, the sum over the "
                              "ranks: divide by the world size")
            if first_difference(p.grad, own.grad, **_CLOSE) is None:
                return failed(f"backward {iteration}: `{name}`'s gradient is this rank's own: the bucket was not "
                              "all-reduced before the future's value was set")
            return failed(f"backward {iteration}: `{name}`'s gradient differs from DDP's at {wrong}")
    return passed(f"{len(default_buckets)} bucket{'s' if len(default_buckets) > 1 else ''} after the rebuild",
                  buckets=len(default_buckets))
