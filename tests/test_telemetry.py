"""distlab.watch on the ranks: what it records, that it changes nothing, and that it goes away."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch

import distlab
from distlab.dashboard import analysis
from distlab.telemetry import Watch, WatchConfig, watch
from distlab.telemetry.stats import LayerIndex
from distlab.telemetry.watch_config import make_config

# Defined on every rank by the tests below: a small model, a data stream per rank, a training loop.
SETUP = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))

def batches(steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        yield x, x[:, :4].sin()

def train(model, steps, data_seed, after_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(batches(steps, data_seed)):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if after_step is not None:
            after_step(model, "before")
        opt.step()
        distlab.log(loss=loss)
        if after_step is not None:
            after_step(model, "after")
    return [p.detach().clone() for p in model.parameters()]
"""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, steps: int, opt: torch.optim.Optimizer | None = None) -> None:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(5, 4, generator=g)).square().mean()
        loss.backward()
        opt.step()
        distlab.log(loss=loss)


# ------------------------------------------------------------------ on one process, no cluster


def test_watch_options_are_checked_and_errors_name_the_fix():
    with pytest.raises(TypeError, match=r"unknown option.*stats_evry.*stats_every"):
        watch(_model(), stats_evry=3)
    with pytest.raises(ValueError, match="checksum_every must be >= 0, like checksum_every=10"):
        watch(_model(), checksum_every=-1)
    with pytest.raises(ValueError, match="publish_interval_s must be a number of seconds > 0"):
        watch(_model(), publish_interval_s=0)
    with pytest.raises(TypeError, match=r"torch.nn.Module"):
        watch("not a model")


def test_log_without_an_open_watch_does_nothing():
    assert distlab.telemetry.active() is None
    distlab.log(loss=1.0)  # a loop keeps its logging when nothing watches it


def test_one_record_per_optimizer_step_with_the_logged_loss_and_sampled_statistics():
    model = _model()
    with Watch(model, WatchConfig(stats_every=3, checksum_every=2)) as w:
        _train(model, 7)
    records = w.records()
    assert [r["step"] for r in records] == list(range(7))
    assert all(isinstance(r["loss"], float) for r in records)
    assert [bool(r["grad_norm"]) for r in records] == [s % 3 == 0 for s in range(7)]
    assert [r["checksum"] is not None for r in records] == [s % 2 == 0 for s in range(7)]
    assert set(records[0]["grad_norm"]) == set(records[0]["weight_norm"]) == {"0", "2"}
    for r in records:
        assert r["compute_s"] + r["comm_s"] == pytest.approx(r["step_time_s"])


def test_evaluation_forwards_and_gradient_accumulation_do_not_count_as_steps():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Watch(model, WatchConfig()) as w:
        for _ in range(3):
            opt.zero_grad()
            for _ in range(4):  # accumulate over 4 micro-batches, one update
                model(torch.randn(2, 4)).sum().backward()
            opt.step()
            with torch.no_grad():
                model(torch.randn(2, 4))  # evaluation
    assert [r["step"] for r in w.records()] == [0, 1, 2]


def test_an_optimizer_of_another_model_does_not_end_the_watched_step():
    model, other = _model(), _model()
    opt, other_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    with Watch(model, WatchConfig()) as w:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            other(torch.randn(2, 4)).sum().backward()
            other_opt.step()
            opt.step()
    assert len(w.records()) == 2


def test_engine_buffers_are_bounded():
    model = _model()
    with Watch(model, WatchConfig(buffer_steps=5)) as w:
        _train(model, 12)
    assert [r["step"] for r in w.records()] == [7, 8, 9, 10, 11]


def test_publishes_are_rate_limited_and_carry_overlapping_windows():
    model = _model()
    sent: list[dict] = []
    interval = 0.1
    with Watch(model, WatchConfig(publish_interval_s=interval, window_steps=1000), sender=sent.append) as w:
        t0 = time.monotonic()
        for _ in range(12):
            _train(model, 5)
            time.sleep(0.03)
        elapsed = time.monotonic() - t0
    payloads = [p["distlab.telemetry"] for p in sent]
    assert payloads[-1]["final"] and not any(p["final"] for p in payloads[:-1])
    live = payloads[:-1]
    assert 2 <= len(live) <= elapsed / interval + 2
    # Every step reached the client, and consecutive windows overlap: losing one publish loses nothing.
    assert sorted({r["step"] for p in payloads for r in p["records"]}) == list(range(60))
    for a, b in itertools.pairwise(live):
        assert {r["step"] for r in a["records"]} & {r["step"] for r in b["records"]}
    assert w.publishes == len(sent)


def test_a_new_watch_closes_the_previous_one_on_this_rank():
    model = _model()
    first = watch(model, publish=False)
    second = watch(model, publish=False)
    try:
        assert first.closed and not second.closed
        assert len(model._forward_pre_hooks) == 1
    finally:
        second.close()
    assert not model._forward_pre_hooks


def test_layer_norms_are_batched_but_equal_torchs():
    model = _model()
    _train(model, 1)
    index = LayerIndex(model)
    for name, layer in model.named_children():
        params = list(layer.parameters())
        if not params:
            continue
        want_w = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in params])).item()
        want_g = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params])).item()
        assert index.weight_norms()[name] == pytest.approx(want_w, rel=1e-6)
        assert index.grad_norms()[name] == pytest.approx(want_g, rel=1e-6)


def test_checksums_see_a_single_changed_weight_and_nothing_else():
    model = _model()
    index = LayerIndex(model)
    before = index.checksums()
    assert index.checksums() == before
    with torch.no_grad():
        model[2].weight[0, 0] = torch.nextafter(model[2].weight[0, 0], torch.tensor(math.inf))
    after = index.checksums()
    assert after["0"] == before["0"] and after["2"] != before["2"]


# ------------------------------------------------------------------ on a real 2-rank gloo lab


@pytest.mark.cluster
def test_training_with_and_without_watch_gives_bit_identical_parameters(lab):
    lab.run(SETUP, stream=False)
    same = lab.run(
        "plain = train(DDP(make_model()), 12, data_seed=rank)\n"
        "model = DDP(make_model())\n"
        "with distlab.watch(model, stats_every=1, checksum_every=1):\n"
        "    watched = train(model, 12, data_seed=rank)\n"
        "[torch.equal(a, b) for a, b in zip(plain, watched)]",
        stream=False,
    )
    assert same == {0: [True] * 6, 1: [True] * 6}


@pytest.mark.cluster
def test_a_closed_watch_leaves_no_hook_and_training_matches_an_unwatched_model(lab):
    lab.run(SETUP, stream=False)
    result = lab.run(
        "import gc, weakref\n"
        "from torch.optim.optimizer import _global_optimizer_post_hooks\n"
        "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
        "hooks_before = len(_global_optimizer_post_hooks)\n"
        "model = DDP(make_model())\n"
        "with distlab.watch(model) as w:\n"
        "    train(model, 3, data_seed=rank)\n"
        "    stand_in = weakref.ref(w._timer.group)\n"
        "gc.collect()\n"
        "left = (len(model._forward_pre_hooks), len(_global_optimizer_post_hooks) - hooks_before,\n"
        "        model._get_ddp_logging_data().get('comm_hook', ''), stand_in() is None, len(w.records()))\n"
        "after_close = train(model, 5, data_seed=rank + 10)\n"
        # DDP refuses a second communication hook: the user's own is accepted after a watch.
        "model.register_comm_hook(None, default_hooks.allreduce_hook)\n"
        "after_users_hook = train(model, 2, data_seed=rank + 20)\n"
        "reference = DDP(make_model())\n"
        "train(reference, 3, data_seed=rank)\n"
        "expected = train(reference, 5, data_seed=rank + 10)\n"
        "expected_2 = train(reference, 2, data_seed=rank + 20)\n"
        "(left, all(torch.equal(a, b) for a, b in zip(after_close, expected)),\n"
        " all(torch.equal(a, b) for a, b in zip(after_users_hook, expected_2)))",
        stream=False,
    )
    for rank in (0, 1):
        (pre_hooks, optimizer_hooks, comm_hook, stand_in_gone, recorded), identical, identical_2 = result[rank]
        # No hook of any kind is left, and the reducer no longer holds the timing stand-in.
        assert (pre_hooks, optimizer_hooks, comm_hook, stand_in_gone) == (0, 0, "", True)
        assert recorded == 3  # nothing recorded after close
        assert identical and identical_2


@pytest.mark.cluster
def test_a_model_with_its_own_communication_hook_is_watched_untimed_and_says_why(lab):
    lab.run(SETUP, stream=False)
    result = lab.run(
        "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
        "model = DDP(make_model())\n"
        "model.register_comm_hook(None, default_hooks.allreduce_hook)\n"
        "with distlab.watch(model) as w:\n"
        "    train(model, 2, data_seed=rank)\n"
        "([r['allreduce'] for r in w.records()], w.notes)",
        stream=False,
    )
    for rank in (0, 1):
        buckets, notes = result[rank]
        assert buckets == [[], []]
        assert notes == ["all-reduce not timed: this DDP model has a communication hook (allreduce_hook)"]


@pytest.mark.cluster
@pytest.mark.parametrize(
    "options", ["", "static_graph=True", "gradient_as_bucket_view=True", "find_unused_parameters=True"]
)
def test_a_model_watched_closed_and_watched_again_is_timed_again_and_trains_as_unwatched(lab, options):
    lab.run(SETUP, stream=False)
    result = lab.run(
        f"model = DDP(make_model(), {options})\n"
        "with distlab.watch(model) as w1:\n"
        "    train(model, 2, data_seed=rank)\n"
        "train(model, 2, data_seed=rank + 5)\n"
        "with distlab.watch(model) as w2:\n"
        "    train(model, 3, data_seed=rank + 9)\n"
        "final = train(model, 2, data_seed=rank + 13)\n"
        f"reference = DDP(make_model(), {options})\n"
        "for steps, seed in ((2, rank), (2, rank + 5), (3, rank + 9), (2, rank + 13)):\n"
        "    expected = train(reference, steps, data_seed=seed)\n"
        "([[sum(b['bytes'] for b in r['allreduce']) for r in w.records()] for w in (w1, w2)],\n"
        " all(torch.equal(a, b) for a, b in zip(final, expected)), w1.notes + w2.notes)",
        stream=False,
    )
    grad_bytes = 4 * sum((8 * 32 + 32, 32 * 32 + 32, 32 * 4 + 4))
    for rank in (0, 1):
        assert result[rank] == ([[grad_bytes] * 2, [grad_bytes] * 3], True, [])


@pytest.mark.cluster
def test_shown_norms_and_update_ratios_equal_those_computed_with_torch(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    expected = lab.run(
        "seen = {}\n"
        "def layer_norms(model, attr):\n"
        "    out = {}\n"
        "    for name, layer in model.module.named_children():\n"
        "        ps = [getattr(p, attr) for p in layer.parameters()]\n"
        "        if ps:\n"
        "            out[name] = torch.linalg.vector_norm(torch.cat([t.detach().flatten() for t in ps])).item()\n"
        "    return out\n"
        "def record(model, when):\n"
        "    if when == 'before':\n"
        "        seen['before'] = [p.detach().clone() for p in model.parameters()]\n"
        "        return\n"
        "    step = len(seen) - 1\n"
        "    grads = layer_norms(model, 'grad')\n"
        "    weights = layer_norms(model, 'data')\n"
        "    ratios = {}\n"
        "    i = 0\n"
        "    for name, layer in model.module.named_children():\n"
        "        n = len(list(layer.parameters()))\n"
        "        if n:\n"
        "            old = seen['before'][i:i + n]\n"
        "            new = [p.detach() for p in layer.parameters()]\n"
        "            change = torch.linalg.vector_norm(torch.cat([(a - b).flatten() for a, b in zip(new, old)]))\n"
        "            ratios[name] = (change / torch.linalg.vector_norm(torch.cat([b.flatten() for b in old]))).item()\n"
        "            i += n\n"
        "    seen[step] = (grads, weights, ratios)\n"
        "model = DDP(make_model())\n"
        "with distlab.watch(model, stats_every=2):\n"
        "    train(model, 6, data_seed=rank, after_step=record)\n"
        "{k: v for k, v in seen.items() if k != 'before'}",
        stream=False,
    )
    records = {(r["rank"], r["step"]): r for r in store.records()}
    assert len(records) == 12
    for rank, steps in expected.items():
        for step, (grads, weights, ratios) in steps.items():
            rec = records[(rank, step)]
            if step % 2:
                assert rec["grad_norm"] == rec["weight_norm"] == rec["update_ratio"] == {}
                continue
            assert set(rec["grad_norm"]) == {"0", "2", "4"}
            for name in grads:
                assert rec["grad_norm"][name] == pytest.approx(grads[name], rel=1e-5)
                assert rec["weight_norm"][name] == pytest.approx(weights[name], rel=1e-5)
                assert rec["update_ratio"][name] == pytest.approx(ratios[name], rel=1e-4)
    # DDP averaged the gradients: both ranks show the same norms
    assert records[(0, 4)]["grad_norm"] == pytest.approx(records[(1, 4)]["grad_norm"], rel=1e-6)


@pytest.mark.cluster
def test_every_steps_allreduce_bytes_equal_the_models_gradient_bytes(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    grad_bytes = lab.run(
        "model = DDP(make_model(), bucket_cap_mb=0.002)  # several buckets on a small model\n"
        "with distlab.watch(model):\n"
        "    train(model, 5, data_seed=rank)\n"
        "sum(p.numel() * p.element_size() for p in model.parameters())",
        stream=False,
    )
    records = store.records()
    assert len(records) == 10
    for rec in records:
        assert sum(b["bytes"] for b in rec["allreduce"]) == grad_bytes[rec["rank"]]
        if rec["step"] > 0:  # DDP rebuilds its buckets, at the size asked, after the first step
            assert len(rec["allreduce"]) > 1
        for b in rec["allreduce"]:
            assert b["seconds"] > 0
            assert b["busbw"] == pytest.approx(b["algbw"] * 2 * (2 - 1) / 2)
            assert b["algbw"] == pytest.approx(b["bytes"] / b["seconds"])
        assert 0 <= rec["comm_s"] <= rec["step_time_s"]
        assert rec["compute_s"] == pytest.approx(rec["step_time_s"] - rec["comm_s"])
    assert {m["grad_bytes"] for m in store.meta().values()} == set(grad_bytes.values())


@pytest.mark.cluster
def test_replicas_without_ddp_and_with_different_seeds_are_flagged_and_the_cause_named(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    lab.run(
        "model = make_model(seed=rank)\n"
        "with distlab.watch(model, checksum_every=2):\n"
        "    train(model, 6, data_seed=rank)",
        stream=False,
    )
    verdict = analysis.divergence(store.records(), store.meta())
    assert verdict.diverged and verdict.started_apart
    assert verdict.ranks == [1] and verdict.layers == ["0", "2", "4"]
    assert verdict.mismatch_steps == [0, 2, 4]
    assert "rank 1 differs from rank 0 in 3 of 3 layers" in verdict.message
    assert "different weights" in verdict.message and "torch.manual_seed" in verdict.message


@pytest.mark.cluster
def test_weights_that_are_each_ranks_own_are_not_taken_for_replicas(lab):
    # An expert of expert parallelism, a stage trained by hand: different weights on purpose.
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    lab.run(
        "model = make_model(seed=rank)\n"
        "with distlab.watch(model, checksum_every=2, replicated=False):\n"
        "    train(model, 4, data_seed=rank)",
        stream=False,
    )
    meta = store.meta()
    assert all(m["replicated"] is False and m["layout"] is None for m in meta.values())
    verdict = analysis.divergence(store.records(), meta)
    assert not verdict.diverged and "its own" in verdict.message
    lines = analysis.summary(store.records(), meta, 2)
    assert "communication in flight" in lines[1] and "exposed all-reduce" not in lines[1], lines
    with pytest.raises(distlab.LabUsageError, match="replicated must be True or False"):
        make_config(None, {"replicated": "no"})


@pytest.mark.cluster
def test_replicas_that_start_equal_but_average_nothing_are_flagged_as_drifting(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    lab.run(
        "model = make_model(seed=0)\n"
        "with distlab.watch(model, checksum_every=1):\n"
        "    train(model, 3, data_seed=rank)",
        stream=False,
    )
    verdict = analysis.divergence(store.records(), store.meta())
    assert verdict.diverged and not verdict.started_apart
    assert verdict.first_step == 0
    assert "gradients are not averaged" in verdict.message


@pytest.mark.cluster
def test_ddp_replicas_are_not_flagged(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    lab.run(
        "model = DDP(make_model(seed=rank))  # DDP broadcasts rank 0's weights\n"
        "with distlab.watch(model, checksum_every=1):\n"
        "    train(model, 4, data_seed=rank)",
        stream=False,
    )
    verdict = analysis.divergence(store.records(), store.meta())
    assert not verdict.diverged and verdict.checked_steps == 4
    assert verdict.message == "replicas agree: checksums equal on all 2 ranks at 4 steps"


@pytest.mark.cluster
def test_a_zero_sharded_optimizer_steps_once_per_update_and_replicas_agree(lab):
    # ZeroRedundancyOptimizer steps its local optimizer, then broadcasts the shards: the step ends there.
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    lab.run(
        "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
        "model = DDP(make_model())\n"
        "opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)\n"
        "with distlab.watch(model, checksum_every=1):\n"
        "    for x, y in batches(3, seed=rank):\n"
        "        opt.zero_grad()\n"
        "        torch.nn.functional.mse_loss(model(x), y).backward()\n"
        "        opt.step()",
        stream=False,
    )
    verdict = analysis.divergence(store.records(), store.meta())
    assert [r["step"] for r in store.records(0)] == [0, 1, 2]
    assert not verdict.diverged, verdict.message


@pytest.mark.cluster
def test_gradients_averaged_by_hand_are_timed_and_keep_replicas_equal(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    grad_bytes = lab.run(
        "model = make_model()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "with distlab.watch(model, checksum_every=1) as w:\n"
        "    for x, y in batches(4, seed=rank):\n"
        "        opt.zero_grad()\n"
        "        torch.nn.functional.mse_loss(model(x), y).backward()\n"
        "        for p in model.parameters():\n"
        "            w.all_reduce(p.grad)\n"
        "            p.grad /= world_size\n"
        "        opt.step()\n"
        "sum(p.numel() * p.element_size() for p in model.parameters())",
        stream=False,
    )
    records = store.records()
    assert len(records) == 8
    for rec in records:
        assert sum(b["bytes"] for b in rec["allreduce"]) == grad_bytes[rec["rank"]]
        assert rec["comm_s"] == pytest.approx(sum(b["seconds"] for b in rec["allreduce"]))
    assert not analysis.divergence(records, store.meta()).diverged


@pytest.mark.cluster
def test_telemetry_reaches_the_notebook_while_the_cell_runs_at_a_bounded_rate(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    arrivals: list[tuple[float, int]] = []

    def seen(final: bool) -> None:
        arrivals.append((time.monotonic(), len(store)))

    store.subscribe(seen)
    t0 = time.monotonic()
    try:
        published = lab.run(
            "import time\n"
            "model = DDP(make_model())\n"
            "t0 = time.monotonic()\n"
            "with distlab.watch(model, publish_interval_s=0.25) as w:\n"
            "    for _ in range(40):\n"
            "        train(model, 1, data_seed=rank)\n"
            "        time.sleep(0.05)\n"
            "(w.publishes, time.monotonic() - t0)",
            stream=False,
        )
    finally:
        store.unsubscribe(seen)
    ended = time.monotonic()
    first_data = next(t for t, n in arrivals if n > 0)
    assert first_data - t0 < ended - t0 - 1.0, "telemetry arrived only when the cell ended"
    for count, elapsed in published.values():
        assert count <= elapsed / 0.25 + 2
    assert len(store.records()) == 80


@pytest.mark.cluster
def test_a_watch_left_open_shows_every_step_when_the_cell_ends_and_goes_on_in_the_next(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    # One publish per minute: without the flush at the end of the cell only the first step would arrive.
    lab.run("model = DDP(make_model())\n"
            "w = distlab.watch(model, publish_interval_s=60)\n"
            "train(model, 7, data_seed=rank)", stream=False)
    steps = {rank: sorted(r["step"] for r in store.records() if r["rank"] == rank) for rank in (0, 1)}
    assert steps == {0: list(range(7)), 1: list(range(7))}
    assert all(r["loss"] is not None for r in store.records())
    lab.run("train(model, 3, data_seed=rank + 1)", stream=False)
    steps = {rank: sorted(r["step"] for r in store.records() if r["rank"] == rank) for rank in (0, 1)}
    assert steps == {0: list(range(10)), 1: list(range(10))}
    lab.run("w.close()", stream=False)
