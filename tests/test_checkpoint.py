"""distlab.checkpoint: atomic saves that survive SIGKILL, bit-exact resume, and a change of world size."""

from __future__ import annotations

import collections
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from distlab import checkpoint
from distlab.checkpoint import CheckpointError

# The training set-up every resume test uses, on the ranks and in this process alike. 64 samples,
# batch 4 per rank: 8 steps per epoch on 2 ranks, 16 on 1. Dropout, input noise from torch, python
# and numpy: each of the three RNGs changes the losses, so resuming bit for bit needs all of them.
SETUP = """
import random
import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from distlab import checkpoint

def build(seed, num_replicas=None, rank=None):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    model = net
    if torch.distributed.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    sampler = DistributedSampler(data, num_replicas=num_replicas, rank=rank, shuffle=True, seed=7)
    # Its own generator: iter(loader) then draws nothing from the global RNG (see checkpoint's docstring).
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    return model, opt, sched, sampler, loader

def train(model, opt, sched, sampler, loader, step, stop, save_to=None):
    losses = []
    while step < stop:
        epoch, done = divmod(step, len(loader))
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < done:
                continue  # taken before the checkpoint
            if step == stop:
                break
            noise = 0.01 * torch.randn_like(x) * (1 + random.random()) + 1e-3 * float(np.random.rand())
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x + noise), y)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach().clone())
            step += 1
            if save_to is not None and step == save_to[0]:
                checkpoint.save(save_to[1], model=model, optimizer=opt, step=step, sampler=sampler,
                                scheduler=sched, extra={"note": "mid-epoch"})
    return losses
"""


def _setup() -> dict:
    namespace: dict = {}
    exec(SETUP, namespace)  # noqa: S102 - the code the ranks run as text, run here too
    return namespace


@contextmanager
def _rng_kept() -> Iterator[None]:
    """load() restores RNG states into this process: give the other tests theirs back."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# --------------------------------------------------------------------------- one process, no cluster


def test_single_process_resume_reproduces_the_next_losses_bit_for_bit(tmp_path):
    ns = _setup()
    with _rng_kept():
        model, opt, sched, sampler, loader = ns["build"](0, num_replicas=1, rank=0)
        path = checkpoint.path_for(tmp_path, 20)
        ns["train"](model, opt, sched, sampler, loader, 0, 20, save_to=(20, path))
        expected = ns["train"](model, opt, sched, sampler, loader, 20, 30)

        model, opt, sched, sampler, loader = ns["build"](123, num_replicas=1, rank=0)
        torch.rand(7), random.random(), np.random.rand()  # move every RNG away from the saved point
        info = checkpoint.load(path, model=model, optimizer=opt, sampler=sampler, scheduler=sched)
        assert sampler.epoch == 1 and sched.last_epoch == 20 and sched.get_last_lr() == [1e-2 * 0.5**4]
        got = ns["train"](model, opt, sched, sampler, loader, info["step"], info["step"] + 10)

    assert info == {"step": 20, "epoch": 1, "extra": {"note": "mid-epoch"}, "world_size": 1, "rng": "restored",
                    "path": path}
    assert len(got) == 10 and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_checkpoint_loads_with_plain_torch_load_weights_only(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with _rng_kept():
        import numpy  # noqa: F401  (numpy's RNG state is saved when numpy is in use)

        path = checkpoint.save(tmp_path / "c.pt", model=model, optimizer=opt, step=1, extra={"lr": [0.1, 0.2]})
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == checkpoint.FORMAT and raw["version"] == checkpoint.VERSION
    assert set(raw["model"]) == {"weight", "bias"} and torch.equal(raw["model"]["weight"], model.weight)
    assert torch.equal(raw["optimizer"]["state"][0]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])
    assert raw["world_size"] == 1 and set(raw["rng"][0]) >= {"torch", "python", "numpy"}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left behind


def test_latest_is_the_highest_step_and_never_a_temporary_file(tmp_path):
    assert checkpoint.latest(tmp_path / "nowhere") is None
    assert checkpoint.latest(tmp_path) is None
    model = torch.nn.Linear(2, 2)
    for step in (9, 120, 30):
        checkpoint.save(checkpoint.path_for(tmp_path, step), model=model, step=step)
    (tmp_path / ".ckpt-00000999.pt.tmp-host-1-ab").write_bytes(b"torn")  # what a killed writer leaves
    (tmp_path / "ckpt-notes.txt").write_text("not a checkpoint")
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt-00000120.pt"
    assert checkpoint.read(checkpoint.latest(tmp_path))["step"] == 120


def test_a_refused_load_changes_nothing(tmp_path):
    model = torch.nn.Linear(3, 3)
    path = checkpoint.save(tmp_path / "c.pt", model=model, optimizer=torch.optim.Adam(model.parameters()), step=4)
    other = torch.nn.Linear(3, 3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    state_before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="holds Adam state; this optimizer is a SGD"):
        checkpoint.load(path, model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert torch.equal(torch.get_rng_state(), state_before)


def test_loading_never_runs_code_from_the_file(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"format": checkpoint.FORMAT, "version": 1, "x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=re.escape("not written by distlab.checkpoint.save")) as exc:
        checkpoint.load(tmp_path / "evil.pt", model=torch.nn.Linear(1, 1))
    _one_line(exc)
    assert not marker.exists()


@pytest.fixture
def saved(tmp_path) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    sampler = DistributedSampler(TensorDataset(torch.zeros(10)), num_replicas=1, rank=0, seed=5)
    sampler.set_epoch(2)
    return checkpoint.save(tmp_path / "c.pt", model=model, step=7, sampler=sampler)


def test_missing_file_names_the_path_and_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError) as exc:
        checkpoint.load(tmp_path / "none.pt", model=torch.nn.Linear(1, 1))
    assert str(tmp_path / "none.pt") in _one_line(exc) and "checkpoint.latest" in str(exc.value)


def test_model_mismatch_names_missing_and_unexpected_keys(saved):
    wrong = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with pytest.raises(CheckpointError) as exc:
        checkpoint.load(saved, model=wrong)
    assert "missing 2.weight, 2.bias; unexpected 1.weight, 1.bias" in _one_line(exc)


def test_shape_mismatch_names_the_key_and_both_shapes(saved):
    wrong = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1))
    with pytest.raises(CheckpointError) as exc:
        checkpoint.load(saved, model=wrong)
    assert "0.weight has shape (8, 4) in the checkpoint, (16, 4) in the model" in _one_line(exc)


def test_a_sampler_that_would_shuffle_differently_is_refused(saved):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    other = DistributedSampler(TensorDataset(torch.zeros(10)), num_replicas=1, rank=0, seed=6)
    with pytest.raises(CheckpointError) as exc, _rng_kept():
        checkpoint.load(saved, model=model, sampler=other)
    assert "sampler of seed 5, this one has 6" in _one_line(exc)
    assert other.epoch == 0


def test_files_that_are_not_good_checkpoints_are_refused_clearly(saved, tmp_path):
    data = bytearray(saved.read_bytes())
    weight_at = data.index(torch.load(saved, weights_only=True)["model"]["0.weight"].numpy().tobytes()) + 5
    damaged, truncated, plain = tmp_path / "damaged.pt", tmp_path / "truncated.pt", tmp_path / "plain.pt"
    damaged.write_bytes(bytes(data[:weight_at]) + bytes([data[weight_at] ^ 0x10]) + bytes(data[weight_at + 1 :]))
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    torch.save(torch.nn.Linear(2, 2).state_dict(), plain)
    newer = tmp_path / "newer.pt"
    raw = torch.load(saved, weights_only=True)
    raw["version"] = checkpoint.VERSION + 1
    torch.save(raw, newer)
    cases = {
        damaged: "is damaged: its content does not match the digest",
        truncated: "is not a readable checkpoint (truncated, damaged, or not a torch file)",
        plain: "is not a distlab checkpoint (found ['bias', 'weight'])",
        newer: f"format version {checkpoint.VERSION + 1}; this distlab reads up to {checkpoint.VERSION}",
        tmp_path: "is a directory",
    }
    for path, message in cases.items():
        with pytest.raises(CheckpointError) as exc:
            checkpoint.read(path)
        assert message in _one_line(exc) and str(path) in str(exc.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"model": {"w": 1}, "step": 1}, TypeError, "model must be a torch.nn.Module"),
        ({"step": -1}, TypeError, "step must be >= 0, like the number of optimizer steps taken so far"),
        ({"step": True}, TypeError, "step must be a whole number, like the number of optimizer steps taken so far"),
        ({"step": 1, "optimizer": "adam"}, TypeError, "optimizer must be a torch.optim.Optimizer"),
        ({"step": 1, "sampler": [0, 1]}, TypeError, "sampler must be a DistributedSampler"),
        ({"step": 1, "extra": {"cfg": {"a": np.zeros(2)}}}, TypeError, r"extra\['cfg'\]\['a'\] is a numpy.ndarray"),
        ({"step": 1, "extra": {"s": {1, 2}}}, TypeError, r"extra\['s'\] is a builtins.set"),
    ],
)
def test_bad_arguments_to_save_get_one_clear_line(tmp_path, kwargs, error, message):
    kwargs = {"model": torch.nn.Linear(1, 1), **kwargs}
    with pytest.raises(error, match=message) as exc:
        checkpoint.save(tmp_path / "c.pt", **kwargs)
    _one_line(exc)
    assert not any(tmp_path.iterdir())  # nothing written, not even a temporary file


# ------------------------------------------------------------------------------ SIGKILL during saves

# Runs in a subprocess. Forks writers that save over one path, step after step, each with weights that
# are a function of the step; SIGKILLs each at a random moment, then asks the test to check the file.
# Forking from one process that imported torch (and never ran a parallel op) makes each writer start in
# milliseconds; starting 50 Pythons that import torch would take minutes on two cores.
KILLER = r"""
import json, os, random, select, signal, sys, time
import torch
torch.set_num_threads(1)
from distlab import checkpoint

path, seed, kills = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
exec(sys.argv[4])  # make_model, set_state: shared with the test

model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.zeros(1, 1024)).sum().backward()
opt.step()  # the optimizer now holds momentum buffers, as in training

def write_forever(step, ack, began):
    while True:
        set_state(model, opt, step)
        checkpoint.save(path, model=model, optimizer=opt, step=step, extra={"step": step})
        os.write(ack, b"%d %.6f\n" % (step, time.perf_counter() - began))
        step += 1

rng = random.Random(seed)
start = 0
first_save_s = None  # from fork to the first save done, as the last writer that got there measured it
for kill in range(kills):
    r, w = os.pipe()
    began = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            write_forever(start, w, began)
        finally:
            os._exit(1)
    os.close(w)
    if kill < 3:  # early kills: any moment of the first save, so the file may not exist yet
        time.sleep(rng.uniform(0.0, 0.03))
    elif first_save_s is None:  # let one writer finish a save, to time it
        select.select([r], [], [], 30)
    else:  # a random moment of the writer's first two saves, timed on this machine under its load now
        time.sleep(rng.uniform(0.0, 2.0 * first_save_s))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    acks = b""
    while chunk := os.read(r, 4096):
        acks += chunk
    os.close(r)
    done = [(int(step), float(at)) for step, at in (line.split() for line in acks.decode().splitlines())]
    if done:
        first_save_s = done[0][1]
    done = [step for step, _ in done]
    print(json.dumps({"kill": kill, "pid": pid, "start": start, "acked": done[-1] if done else None}), flush=True)
    start = int(sys.stdin.readline())  # the test checked the file; it says which step comes next
"""

# Weights and momentum are a function of the step, so a file's content can be checked against its step.
KILL_COMMON = r"""
import torch

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 64))  # 2.2 MB, 4.4 with momentum

_base = []

def expected(model, step):
    if not _base:  # made once: the writers' time goes to saving
        _base.extend(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / p.numel()
                     for p in model.parameters())
    return [b + step for b in _base], [b - 2 * step for b in _base]

def set_state(model, opt, step):
    weights, momenta = expected(model, step)
    with torch.no_grad():
        for p, w, m in zip(model.parameters(), weights, momenta):
            p.copy_(w)
            opt.state[p]["momentum_buffer"].copy_(m)
"""


@pytest.mark.cluster
def test_a_writer_killed_at_random_moments_never_leaves_a_wrong_checkpoint(tmp_path):
    kills = 50
    common: dict = {}
    exec(KILL_COMMON, common)  # noqa: S102 - the code the writers run, to check their files
    model = common["make_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "ckpt.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLER, str(path), "1234", str(kills), KILL_COMMON],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    outcomes: collections.Counter = collections.Counter()
    torn_temps = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # idle intra-op threads spin after each op, taking the CPU the writers need
    on_disk: int | None = None  # the step the file held after the previous kill
    t0 = time.perf_counter()
    try:
        assert proc.stdin is not None and proc.stdout is not None
        for _ in range(kills):
            line = proc.stdout.readline()
            assert line, f"the killer process died: rc {proc.wait()}"
            report = json.loads(line)
            acked, start = report["acked"], report["start"]
            visible = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
            temps = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.pt.tmp-")]
            assert visible in ([], ["ckpt.pt"]) and len(temps) + len(visible) == len(list(tmp_path.iterdir()))
            # Killed between creating its temporary file and renaming it (dead writers' files go at the next save).
            torn_temps += any(f"-{report['pid']}-" in name for name in temps)
            if not path.exists():
                assert on_disk is None and acked is None, "a checkpoint that was written is gone"
                outcomes["absent"] += 1
                proc.stdin.write("0\n")
                proc.stdin.flush()
                continue
            # The last save known complete (acknowledged in this run, or the file before it), or the
            # one after it: complete on disk, killed before it could acknowledge.
            last = acked if acked is not None else on_disk
            with _rng_kept():
                info = checkpoint.load(path, model=model, optimizer=opt)
            step = info["step"]
            weights, momenta = common["expected"](model, step)
            assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)), f"weights wrong at {step}"
            assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momenta))
            assert info["extra"] == {"step": step}
            if step == last:
                outcomes["old"] += 1
            else:
                assert step == (start if last is None or last < start else last + 1), (step, last, start)
                outcomes["new"] += 1
            on_disk = step
            proc.stdin.write(f"{step + 1}\n")
            proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        torch.set_num_threads(threads)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    elapsed = time.perf_counter() - t0
    print(f"{kills} kills in {elapsed:.1f} s: {dict(outcomes)}, "
          f"killed mid-write (temporary file left) {torn_temps} times")
    assert sum(outcomes.values()) == kills and outcomes["old"] + outcomes["new"] > kills // 2
    assert torn_temps > 0, "no kill landed while a file was being written: the test proved nothing"
    # The next save clears what dead writers left; only the checkpoint is in the directory afterwards.
    checkpoint.save(path, model=model, optimizer=opt, step=on_disk + 1)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


# ------------------------------------------------------------------------------- real 2-rank lab

RESUME = """
ckpt = checkpoint.path_for(ckpt_dir, 12)
model, opt, sched, sampler, loader = build(0)
train(model, opt, sched, sampler, loader, 0, 12, save_to=(12, ckpt))
expected = train(model, opt, sched, sampler, loader, 12, 22)

def resumed(disturb=None):
    model, opt, sched, sampler, loader = build(100 + rank)  # other weights, other RNG states
    torch.rand(3), random.random(), np.random.rand()
    info = checkpoint.load(ckpt, model=model, optimizer=opt, sampler=sampler, scheduler=sched)
    if disturb is not None:
        disturb()
    return info, train(model, opt, sched, sampler, loader, info["step"], info["step"] + 10)

info, got = resumed()
disturbances = {"torch": lambda: torch.rand(1), "python": random.random, "numpy": np.random.rand}
controls = {name: any(not torch.equal(a, b) for a, b in zip(resumed(f)[1], expected))
            for name, f in disturbances.items()}
{
    "info": {k: v for k, v in info.items() if k != "path"},
    "same": [torch.equal(a, b) for a, b in zip(got, expected)],
    "controls": controls,
    "keys": sorted(torch.load(ckpt, weights_only=True)["model"]),
}
"""


@pytest.mark.cluster
def test_resume_on_two_ranks_reproduces_the_next_10_losses_bit_for_bit(lab, tmp_path):
    lab.push(ckpt_dir=str(tmp_path))
    lab.run(SETUP, stream=False)
    result = lab.run(RESUME, stream=False)
    for rank, got in result.items():
        assert got["info"] == {"step": 12, "epoch": 1, "extra": {"note": "mid-epoch"}, "world_size": 2,
                               "rng": "restored"}, rank
        assert len(got["same"]) == 10 and all(got["same"]), f"rank {rank}: {got['same']}"
        # Each RNG matters: one extra draw from any of them after the load, and the losses differ.
        assert got["controls"] == {"torch": True, "python": True, "numpy": True}, rank
        assert got["keys"] == ["0.bias", "0.weight", "3.bias", "3.weight"]  # no DDP "module." prefix
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000012.pt"]


def _same(a, b) -> bool:
    """Equal to the bit, through nested state dicts."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _interleave(shards: list[list[int]]) -> list[int]:
    """The epoch's order from the ranks' shards (DistributedSampler gives rank r the items r, r+N, ...)."""
    order: list[int] = [0] * sum(map(len, shards))
    for rank, shard in enumerate(shards):
        order[rank :: len(shards)] = shard
    return order


SAVE_ON_RANKS = """
model, opt, sched, sampler, loader = build(0)
train(model, opt, sched, sampler, loader, 0, 12)
rng_at_save = torch.get_rng_state()
checkpoint.save(ckpt_path, model=model, optimizer=opt, step=12, sampler=sampler, scheduler=sched)
{"model": model.module.state_dict(), "opt": opt.state_dict(), "rng": rng_at_save, "shard": list(sampler)}
"""


@pytest.mark.cluster
def test_a_checkpoint_saved_on_two_ranks_loads_in_one_process(lab, tmp_path):
    path = tmp_path / "two.pt"
    lab.push(ckpt_path=str(path))
    lab.run(SETUP, stream=False)
    ranks = lab.run(SAVE_ON_RANKS, stream=False)
    assert _same(ranks[0]["model"], ranks[1]["model"])  # DDP replicas, as saved

    ns = _setup()
    with _rng_kept():
        model, opt, sched, sampler, _ = ns["build"](5, num_replicas=1, rank=0)  # other weights, one rank
        info = checkpoint.load(path, model=model, optimizer=opt, sampler=sampler, scheduler=sched)
        rng = torch.get_rng_state()
    assert {k: info[k] for k in ("step", "epoch", "world_size", "rng")} == {
        "step": 12, "epoch": 1, "world_size": 2, "rng": "restored"}
    assert _same(model.state_dict(), ranks[0]["model"])
    assert _same(opt.state_dict(), ranks[0]["opt"])
    assert torch.equal(rng, ranks[0]["rng"])  # rank 0's RNG, as it was when it saved
    # Re-sharded: the one rank now walks the whole of epoch 1, in the order the two ranks shared.
    assert sampler.epoch == 1 and list(sampler) == _interleave([ranks[0]["shard"], ranks[1]["shard"]])


LOAD_ON_RANKS = """
model, opt, sched, sampler, loader = build(100 + rank)
info = checkpoint.load(ckpt_path, model=model, optimizer=opt, sampler=sampler, scheduler=sched)
rng = torch.get_rng_state()
checkpoint.load(ckpt_path, model=model, optimizer=opt, sampler=sampler, scheduler=sched)
{"info": {k: info[k] for k in ("step", "epoch", "world_size", "rng")}, "rng": rng,
 "same_again": torch.equal(rng, torch.get_rng_state()), "model": model.module.state_dict(),
 "opt": opt.state_dict(), "shard": list(sampler), "epoch": sampler.epoch}
"""


@pytest.mark.cluster
def test_a_checkpoint_saved_in_one_process_loads_on_two_ranks(lab, tmp_path):
    ns = _setup()
    path = tmp_path / "one.pt"
    with _rng_kept():
        model, opt, sched, sampler, loader = ns["build"](0, num_replicas=1, rank=0)
        ns["train"](model, opt, sched, sampler, loader, 0, 20)
        saved_rng = torch.get_rng_state()
        checkpoint.save(path, model=model, optimizer=opt, step=20, sampler=sampler, scheduler=sched)
    lab.push(ckpt_path=str(path))
    lab.run(SETUP, stream=False)
    ranks = lab.run(LOAD_ON_RANKS, stream=False)

    for rank, got in ranks.items():
        assert got["info"] == {"step": 20, "epoch": 1, "world_size": 1, "rng": ["restored", "reseeded"][rank]}
        assert _same(got["model"], model.state_dict()) and _same(got["opt"], opt.state_dict())
        assert got["epoch"] == 1 and got["same_again"]  # the new rank's seed is the same every time
    assert torch.equal(ranks[0]["rng"], saved_rng) and not torch.equal(ranks[1]["rng"], saved_rng)
    assert _interleave([ranks[0]["shard"], ranks[1]["shard"]]) == list(sampler)  # epoch 1, re-sharded


ZERO = """
from torch.distributed.optim import ZeroRedundancyOptimizer

def zero_setup(seed):
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)

def zero_steps(model, opt, n):
    losses = []
    for _ in range(n):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses

model, opt = zero_setup(0)
zero_steps(model, opt, 3)
checkpoint.save(ckpt_path, model=model, optimizer=opt, step=3)
expected = zero_steps(model, opt, 3)
model, opt = zero_setup(1)
checkpoint.load(ckpt_path, model=model, optimizer=opt)
[torch.equal(a, b) for a, b in zip(zero_steps(model, opt, 3), expected)]
"""


@pytest.mark.cluster
def test_a_zero_sharded_optimizer_is_saved_whole_and_resumes(lab, tmp_path):
    lab.push(ckpt_path=str(tmp_path / "zero.pt"))
    lab.run(SETUP, stream=False)
    assert lab.run(ZERO, stream=False) == {0: [True] * 3, 1: [True] * 3}
    saved = checkpoint.read(tmp_path / "zero.pt")
    assert saved["optimizer_type"] == "ZeroRedundancyOptimizer" and len(saved["optimizer"]["state"]) == 4
