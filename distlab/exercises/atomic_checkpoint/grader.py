"""Grader of ``atomic-checkpoint``: the learner's save survives a SIGKILL at any moment; their load gives it back.

Each rank grades on its own, in its own fresh temporary folder: no case makes a collective, so a rank
that fails cannot leave another waiting. The first case saves and loads in the rank's own process: every
dtype, a 0-d and an empty tensor, numbers; a truncated file must make the load raise. The other cases
start a process of their own (``sys.executable``) that unpacks the learner's definitions and serves
the grader over a pipe:

- a probe: four saves, alternating two states of a few MB, with ``os.replace``, ``os.rename`` and
  ``os.fsync`` watched (the learner's code calls them through the ``os`` module, patched in that
  process only); what they were called with names a mistake no kill may happen to hit: ``path``
  written in place, a temporary file in another folder, a rename before the file was complete, no
  fsync before the rename, temporary files that pile up;
- kill trials: a forked copy of that process saves the two states in turn until the grader SIGKILLs it
  at a random moment (seeded), and the grader's own process then loads ``path`` with the learner's
  ``load_checkpoint``: it must give exactly one of the two states.

The saving processes never outlive the case: they are killed and reaped in ``finally``, and they die
with their parent (``PR_SET_PDEATHSIG``) should the rank itself be killed. That process and the pipe to it
are ``saver.py``; the two states, made alike on both ends from the case, ``states.py``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping

import torch

from ...rank.exercise import Learner, failed, passed
from .saver import Report, Saver, SaverDied, grading_rank, headline
from .states import Case, State, TensorSpec, difference, mismatches, state

# Kill trials per case, on each rank.
_KILLS = 5
_FILE = "checkpoint.pt"

_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool", "complex64")


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    round_trip: Case = {
        "name": "save, then load: every dtype, a 0-d and an empty tensor, numbers; a torn file must raise",
        "kind": "round trip",
        "tensors": [_spec(f"t_{d}", d, [rng.randrange(1, 6), rng.randrange(1, 9)]) for d in _DTYPES]
        + [_spec("scalar", "float32", []), _spec("empty", "float32", [0, rng.randrange(1, 5)])],
        "seed": rng.randrange(2**31),
    }
    out = [round_trip]
    for megabytes, dtypes in ((3, ("float32", "int64")), (7, ("float32", "bfloat16", "float64", "int8"))):
        width = rng.randrange(200, 400)
        tensors: list[TensorSpec] = []
        for i, dtype in enumerate(dtypes):
            itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            rows = megabytes * 2**20 // len(dtypes) // (width * itemsize) + rng.randrange(1, 50)
            tensors.append(_spec(f"layer{i}.weight", dtype, [rows, width]))
            tensors.append(_spec(f"layer{i}.bias", dtype, [rng.randrange(1, 300)]))
        size = sum(
            _numel(t["shape"]) * torch.empty(0, dtype=getattr(torch, t["dtype"])).element_size() for t in tensors
        )
        out.append(
            {
                "name": f"killed {_KILLS} times mid-save, two states of {size / 2**20:.1f} MiB",
                "kind": "kills",
                "tensors": tensors,
                "seed": rng.randrange(2**31),
            }
        )
    return out


def _spec(name: str, dtype: str, shape: list[int]) -> TensorSpec:
    return {"name": name, "dtype": dtype, "shape": shape}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    root = tempfile.mkdtemp(prefix="distlab-atomic-checkpoint-")
    try:
        folder, elsewhere = os.path.join(root, "checkpoints"), os.path.join(root, "elsewhere")
        os.mkdir(folder)
        os.mkdir(elsewhere)
        path = os.path.join(folder, _FILE)
        if case["kind"] == "round trip":
            return _round_trip(case, learner, path, elsewhere)
        return _kills(case, learner, root, path)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------- round trip, in this process


def _round_trip(case: Case, learner: Learner, path: str, elsewhere: str) -> Mapping[str, object]:
    save, load = learner["save_checkpoint"], learner["load_checkpoint"]
    saved = state(case, 0)
    kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
    # A temporary file made with tempfile's defaults lands in a folder of this case, not in the rank's /tmp.
    before, tempfile.tempdir = tempfile.tempdir, elsewhere
    try:
        save(saved, path)
        wrong = difference(saved, kept)
        if wrong is not None:
            return failed(f"save_checkpoint changed the state it was given: {wrong}")
        if not os.path.isfile(path):
            return failed(f"after save_checkpoint(state, path) there is no file at `path` ({_FILE})")
        wrong = difference(load(path), kept)
        if wrong is not None:
            return failed(f"load_checkpoint(path) after save_checkpoint(state, path) is not the state saved: {wrong}")
        size = os.path.getsize(path)
        torn = os.path.join(os.path.dirname(path), "torn.pt")
        with open(path, "rb") as whole, open(torn, "wb") as half:
            half.write(whole.read(size // 2))
        for what, broken in (
            ("a torn file (the first half of a checkpoint)", torn),
            ("a missing file", path + ".gone"),
        ):
            try:
                got = load(broken)
            except Exception:  # noqa: BLE001, S112 - raising is what is asked; any exception will do
                continue
            return failed(
                f"load_checkpoint returned {_short(got)} for {what} instead of raising: a load that swallows "
                "errors lets a resumed run start silently from nothing; let the exception propagate"
            )
    finally:
        tempfile.tempdir = before
    return passed(checkpoint_bytes=size)


def _short(value: object) -> str:
    text = repr(value) if not isinstance(value, Mapping) else f"a dict of {len(value)} keys"
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------- kills, in a process of its own

def _kills(case: Case, learner: Learner, root: str, path: str) -> Mapping[str, object]:
    rng = random.Random(case["seed"] * 31 + grading_rank())
    states = (state(case, 0), state(case, 1))
    saver = Saver(root, case, learner, path)
    try:
        return _kill_trials(saver, case, learner, path, states, rng)
    except SaverDied as exc:
        return failed(f"the process running save_checkpoint stopped: {exc}")
    finally:
        saver.close()


def _kill_trials(
    saver: Saver,
    case: Case,
    learner: Learner,
    path: str,
    states: tuple[State, State],
    rng: random.Random,
) -> Mapping[str, object]:
    saver.ask("probe")
    report: Report = json.loads(saver.line().removeprefix("P "))
    if "error" in report:
        return failed(f"save_checkpoint raised {report['error']} in the process that saves")
    save_s = sorted(s["seconds"] for s in report["saves"])[len(report["saves"]) // 2]
    problem, advice, note = _diagnose(report, path)
    baseline = len(report["saves"][-1]["others"])

    holds, completed, kills, kill_failure = 1, 0, 0, None  # the probe's last save (4, even count) was state 1
    for trial in range(_KILLS):
        kills += 1
        saver.ask(f"trial {1 - holds}")
        while (answer := saver.line()).startswith("S "):  # the fork's first saves may come before its pid
            completed += 1
        saver.trial_pid = int(answer.removeprefix("T "))
        # The forked saver saves from its first instant: any moment of its life is mid-save.
        time.sleep(rng.uniform(0.0, 2.5 * save_s))
        os.kill(saver.trial_pid, signal.SIGKILL)
        saver.ask(f"reap {saver.trial_pid}")
        saver.trial_pid = None  # killed; the saver reaps it
        errors = []
        while not (answer := saver.line()).startswith("R "):
            if answer.startswith("S "):
                completed += 1
            elif answer.startswith("E "):
                errors.append(answer[2:])
        if errors:
            return failed(f"save_checkpoint raised {errors[0]} in the process that saves")
        try:
            got = learner["load_checkpoint"](path)
        except Exception as exc:  # noqa: BLE001 - a load that fails here is the mistake being graded
            kill_failure = (
                f"load failed after a kill mid-save (kill {trial + 1} of {_KILLS}: {headline(exc)}): "
                "write to a temporary file and os.replace it"
            )
            break
        wrong = [difference(got, s) for s in states]
        if None not in wrong:
            closer = min(range(2), key=lambda w: mismatches(got, states[w])) if isinstance(got, Mapping) else 0
            kill_failure = (
                f"after a kill mid-save (kill {trial + 1} of {_KILLS}) load_checkpoint(path) is neither the "
                f"previous checkpoint nor the new one: {wrong[closer]}: `path` must only ever hold a complete "
                "checkpoint: write to a temporary file and os.replace it"
            )
            break
        holds = wrong.index(None)

    stray = sorted(n for n in os.listdir(os.path.dirname(path)) if n != _FILE)
    measured = {
        "save_s": save_s,
        "checkpoint_bytes": report["saves"][-1]["size"],
        "kills": kills,
        "saves_completed": completed,
        "stray_files": len(stray),
    }
    if kill_failure is not None:
        return failed(kill_failure + (f" (the watched calls show: {problem})" if problem else ""), **measured)
    if problem is not None:
        return failed(f"{problem}: {advice}", **measured)
    if len(stray) > baseline + _KILLS:
        return failed(
            f"{len(stray)} files beside the checkpoint after {_KILLS} kills ({', '.join(stray[:3])}, ...): more than "
            "the kills could leave; temporary files pile up",
            **measured,
        )
    return passed(note, **measured)

def _diagnose(report: Report, path: str) -> tuple[str | None, str | None, str]:
    """What the probe's watched calls show: (the mistake, the advice), or (None, None); and a note on the folder."""
    path_real = os.path.realpath(path)
    folder_real = os.path.dirname(path_real)
    saves = report["saves"]
    note = ""
    for i, save in enumerate(saves):
        events = save["events"]
        onto = [e for e in events if e["op"] == "replace" and e["dst"] == path_real]
        if not onto:
            if i > 0 and save["ino"] == saves[i - 1]["ino"]:
                return (
                    "`path` was written in place (the same file truncated and rewritten, no os.replace onto it)",
                    "a kill mid-write leaves a truncated file: write to a temporary file and os.replace it",
                    note,
                )
            if i > 0:
                return (
                    "no os.replace (or os.rename) onto `path` was seen, yet `path` is a new file after each save",
                    (
                        "a kill between removing the old file and finishing the new one leaves no complete "
                        "checkpoint: write to a temporary file and os.replace it"
                    ),
                    note,
                )
            continue
        move = onto[-1]
        if os.path.dirname(move["src"]) != folder_real:
            same_device = move.get("dev") == report["folder_dev"]
            return (
                f"the temporary file is in another folder ({os.path.dirname(move['src'])}) than the checkpoint",
                "os.replace is atomic only within one filesystem (across filesystems it raises OSError, and a "
                "copy is not atomic)"
                + (
                    "; here both folders happen to be on one filesystem, elsewhere they may not be"
                    if same_device
                    else ""
                )
                + ": make the temporary file in the checkpoint's own folder, os.path.dirname(path)",
                note,
            )
        if move.get("ino") == save["ino"] and move["size"] < save["size"]:
            return (
                (
                    f"the temporary file was renamed onto `path` before it was complete ({move['size']} of "
                    f"{save['size']} bytes written at the rename)"
                ),
                (
                    "a kill just after the rename leaves a truncated checkpoint: flush and fsync it (or close it), "
                    "then os.replace"
                ),
                note,
            )
        fsyncs = [
            e for e in events if e["op"] == "fsync" and (e["dev"], e["ino"]) == (move.get("dev"), move.get("ino"))
        ]
        before = [e["size"] for e in fsyncs if e["seq"] < move["seq"]]
        if not before:
            return (
                "the temporary file was not fsync'ed before os.replace" + (" (only after it)" if fsyncs else ""),
                (
                    "after a power loss the new name may point at bytes that never reached the disk: "
                    "f.flush(), os.fsync(f.fileno()), then os.replace"
                ),
                note,
            )
        if max(before) < move["size"]:
            return (
                (
                    f"the temporary file was fsync'ed before its last bytes were flushed ({max(before)} of "
                    f"{move['size']} bytes in the file at the fsync)"
                ),
                "f.flush() first (Python's buffer to the OS), then os.fsync(f.fileno()), then os.replace",
                note,
            )
        dir_synced = any(
            e["op"] == "fsync"
            and (e["dev"], e["ino"]) == (report["folder_dev"], report["folder_ino"])
            and e["seq"] > move["seq"]
            for e in events
        )
        note = (
            "the folder was fsync'ed after the rename, so the rename itself survives a power loss"
            if dir_synced
            else "optional: fsync the folder after os.replace, so that the rename itself survives a power loss"
        )
    counts = [len(s["others"]) for s in saves]
    if counts[-1] > counts[1]:
        return (
            (
                f"every save leaves a file beside the checkpoint ({counts[1]} after save 2, {counts[-1]} after save "
                f"{len(saves)}: {', '.join(saves[-1]['others'][:2])}, ...)"
            ),
            (
                "the temporary file must be gone once the save is done: os.replace moves it onto `path`; a copy "
                "or a link leaves it behind"
            ),
            note,
        )
    return None, None, note
