"""distlab.records declares what the ranks really emit: a record made by distlab.telemetry, on a real
1-rank DDP model with every statistic sampled, has exactly the declared keys and types, nested parts too."""

from __future__ import annotations

import types
import typing

import torch
from _single_rank import single_rank_group
from torch.nn.parallel import DistributedDataParallel as DDP

import distlab
from distlab import records
from distlab.dashboard.store import TelemetryStore
from distlab.telemetry import Watch, WatchConfig


def _published() -> list[records.Publish]:
    """What a watch of a 1-rank DDP model published over 3 steps (every step sampled, buckets timed)."""
    torch.manual_seed(0)
    sent: list[dict] = []
    with single_rank_group():
        model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = WatchConfig(stats_every=1, checksum_every=1, publish_interval_s=0.01)
        with Watch(model, config, sender=sent.append):
            for epoch in range(3):
                opt.zero_grad()
                loss = model(torch.randn(5, 4)).square().mean()
                loss.backward()
                opt.step()
                distlab.log(loss=loss, epoch=epoch, accuracy=0.5)
    return [payload[records.PUBLISH_KEY] for payload in sent]


def _mismatches(value: object, hint: object, where: str) -> list[str]:
    """Where ``value`` does not have the declared type ``hint`` (TypedDicts: exactly their keys)."""
    if typing.is_typeddict(hint):
        declared = typing.get_type_hints(hint)
        keys = set(value) if isinstance(value, dict) else set()
        wrong = [] if hint.__required_keys__ <= keys <= set(declared) else [f"{where}: keys {sorted(keys)}"]
        return wrong + [m for k in keys & set(declared) for m in _mismatches(value[k], declared[k], f"{where}.{k}")]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return [] if any(not _mismatches(value, a, where) for a in args) else [f"{where}: {value!r} is not {hint}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__} is not a list"]
        return [m for i, v in enumerate(value) for m in _mismatches(v, args[0], f"{where}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__} is not a dict"]
        return [m for k, v in value.items() for m in _mismatches(k, args[0], where) + _mismatches(v, args[1], where)]
    kinds = {float: (int, float), type(None): (type(None),)}.get(hint, (hint,))  # an int is a float, as in typing
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and hint is not bool)
    return [] if ok else [f"{where}: {value!r} is not {hint}"]


def test_every_published_record_has_exactly_the_declared_keys_and_types():
    published = _published()
    steps = [r for p in published for r in p["records"]]
    assert {r["step"] for r in steps} == {0, 1, 2}
    declared = records.StepRecord.__required_keys__
    assert declared == set(typing.get_type_hints(records.StepRecord))  # every field of a record is always there
    for record in steps:
        assert set(record) == declared
    for payload in published:
        assert _mismatches(payload, records.Publish, "publish") == []


def test_a_sampled_step_fills_every_nested_part():
    last = _published()[-1]
    record = last["records"][-1]
    assert record["grad_norm"] and record["weight_norm"] and record["update_ratio"] and record["layer_checksums"]
    assert record["metrics"] == {"accuracy": 0.5} and record["epoch"] == 2
    assert record["allreduce"], "DDP's buckets were timed"
    for bucket in record["allreduce"]:
        assert set(bucket) == set(typing.get_type_hints(records.AllReduceBucket))  # timed: bandwidths too
    assert set(last["meta"]["config"]) == set(typing.get_type_hints(records.SampledEvery))


def test_the_notebook_store_keeps_one_record_per_record_key_in_key_order():
    published = _published()
    store = TelemetryStore(world_size=1)
    for payload in published:
        store.merge(payload)
    keys = [records.record_key(r) for r in store.records()]
    assert keys == sorted(set(keys)) == [records.RecordKey(step, 0) for step in range(3)]
