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
with their parent (``PR_SET_PDEATHSIG``) should the rank itself be killed.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...wire import LEARNER_FILE
from ..exercise import Learner, failed, first_difference, passed

# Kill trials per case, on each rank.
_KILLS = 5
# Saves the probe makes; from the second on, ``path`` already exists (the steady state).
_PROBE_SAVES = 4
# How long the saving process may take to answer one request (its start imports torch: seconds).
_ANSWER_S = 40.0
_FILE = "checkpoint.pt"

_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool", "complex64")


def cases(world_size: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed * 1000 + world_size)
    round_trip = {
        "name": "save, then load: every dtype, a 0-d and an empty tensor, numbers; a torn file must raise",
        "kind": "round trip",
        "tensors": [[f"t_{d}", d, [rng.randrange(1, 6), rng.randrange(1, 9)]] for d in _DTYPES]
        + [["scalar", "float32", []], ["empty", "float32", [0, rng.randrange(1, 5)]]],
        "seed": rng.randrange(2**31),
    }
    out = [round_trip]
    for megabytes, dtypes in ((3, ("float32", "int64")), (7, ("float32", "bfloat16", "float64", "int8"))):
        width = rng.randrange(200, 400)
        tensors = []
        for i, dtype in enumerate(dtypes):
            itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            rows = megabytes * 2**20 // len(dtypes) // (width * itemsize) + rng.randrange(1, 50)
            tensors.append([f"layer{i}.weight", dtype, [rows, width]])
            tensors.append([f"layer{i}.bias", dtype, [rng.randrange(1, 300)]])
        size = sum(_numel(shape) * torch.empty(0, dtype=getattr(torch, d)).element_size() for _, d, shape in tensors)
        out.append(
            {
                "name": f"killed {_KILLS} times mid-save, two states of {size / 2**20:.1f} MiB",
                "kind": "kills",
                "tensors": tensors,
                "seed": rng.randrange(2**31),
            }
        )
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def state(case: Mapping[str, Any], which: int) -> dict[str, Any]:
    """State ``which`` (0 or 1) of the case: its tensors, in the case's dtypes, and three numbers."""
    gen = torch.Generator().manual_seed(case["seed"] * 2 + which)
    out: dict[str, Any] = {"step": 1000 + which, "loss": 2.5 / (which + 3), "lr": 0.1 * (which + 1)}
    for name, dtype_name, shape in case["tensors"]:
        dtype = getattr(torch, dtype_name)
        if dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        elif dtype.is_floating_point or dtype.is_complex:
            exact = dtype in (torch.float32, torch.float64, torch.complex64)
            t = torch.randn(shape, generator=gen, dtype=dtype if exact else torch.float32).to(dtype)
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=gen, dtype=dtype)
        out[name] = t
    return out


def difference(got: Any, expected: Mapping[str, Any]) -> str | None:
    """None if ``got`` is ``expected`` exactly (same keys; tensors: dtype, shape, values; numbers: type, value)."""
    if not isinstance(got, Mapping):
        return f"load_checkpoint returned a {type(got).__name__}, expected the dict that was saved"
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected), key=str)
    if missing:
        return f"the key {missing[0]!r} is missing" + (f" ({len(missing)} missing)" if len(missing) > 1 else "")
    if extra:
        return f"there is a key {extra[0]!r} that was not saved"
    for key, want in expected.items():
        have = got[key]
        if isinstance(want, torch.Tensor):
            wrong = first_difference(have, want)
            if wrong is not None:
                return f"{key!r}: {wrong}"
        elif type(have) is not type(want) or have != want:
            return f"{key!r}: {have!r} ({type(have).__name__}), expected {want!r} ({type(want).__name__})"
    return None


def grade(case: dict[str, Any], learner: Learner) -> dict[str, Any]:
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


def _round_trip(case: dict[str, Any], learner: Learner, path: str, elsewhere: str) -> dict[str, Any]:
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


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, Mapping) else f"a dict of {len(value)} keys"
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------- kills, in a process of its own


class _Saver:
    """The process that saves: started here, asked over its stdin, answering one line at a time on its stdout."""

    def __init__(self, root: str, case: dict[str, Any], learner: Learner, path: str) -> None:
        with open(os.path.join(root, "learner.blob"), "wb") as f:
            f.write(learner.blob)
        with open(os.path.join(root, "case.json"), "w") as f:
            json.dump({"case": case, "path": path, "rank": _rank(), "world_size": _world_size()}, f)
        package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
        env["TMPDIR"] = os.path.join(root, "elsewhere")  # tempfile's default folder: not the checkpoint's
        env["OMP_NUM_THREADS"] = "1"
        self.log = os.path.join(root, "saver.log")
        self._buffer = b""
        self.trial_pid: int | None = None  # a forked saver not yet reaped: killed in close()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import _serve; _serve()", root, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=root,
                env=env,
                start_new_session=True,  # a SIGINT that stops the rank's case goes to the rank, not here
            )

    def ask(self, request: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise _Died(self._last_words()) from None

    def line(self, timeout_s: float = _ANSWER_S) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Died(f"it did not answer in {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise _Died(self._last_words())
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _last_words(self) -> str:
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        with open(self.log, "rb") as f:
            lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
        return f"it exited with status {self.proc.returncode}" + (f": {lines[-1].strip()}" if lines else "")

    def close(self) -> None:
        if self.trial_pid is not None:
            # Still the saver's unreaped child, so the pid cannot have been reused.
            try:
                os.kill(self.trial_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass


class _Died(Exception):
    """The saving process stopped answering."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _kills(case: dict[str, Any], learner: Learner, root: str, path: str) -> dict[str, Any]:
    rng = random.Random(case["seed"] * 31 + _rank())
    states = (state(case, 0), state(case, 1))
    saver = _Saver(root, case, learner, path)
    try:
        return _kill_trials(saver, case, learner, path, states, rng)
    except _Died as exc:
        return failed(f"the process running save_checkpoint stopped: {exc}")
    finally:
        saver.close()


def _kill_trials(
    saver: _Saver,
    case: dict[str, Any],
    learner: Learner,
    path: str,
    states: tuple[dict[str, Any], dict[str, Any]],
    rng: random.Random,
) -> dict[str, Any]:
    saver.ask("probe")
    report = json.loads(saver.line().removeprefix("P "))
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
                f"load failed after a kill mid-save (kill {trial + 1} of {_KILLS}: {_headline(exc)}): "
                "write to a temporary file and os.replace it"
            )
            break
        wrong = [difference(got, s) for s in states]
        if None not in wrong:
            closer = min(range(2), key=lambda w: _mismatches(got, states[w])) if isinstance(got, Mapping) else 0
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


def _headline(exc: BaseException) -> str:
    line = _first_line(exc)
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 80 else line[:77] + "..."


def _mismatches(got: Mapping[str, Any], expected: Mapping[str, Any]) -> int:
    return sum(difference({k: got.get(k)}, {k: v}) is not None for k, v in expected.items())


def _diagnose(report: dict[str, Any], path: str) -> tuple[str | None, str | None, str]:
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


# ---------------------------------------------------------------------------- the saving process


class _Watch:
    """Records os.replace / os.rename / os.fsync calls in this process: what, on which file, in which order."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.seq = 0

    def install(self) -> None:
        import posix

        real_replace, real_rename = os.replace, os.rename
        real_fsync, real_fdatasync = os.fsync, getattr(os, "fdatasync", None)
        watch = self

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            watch.moved(src, dst)
            real_replace(src, dst, *args, **kwargs)

        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            watch.moved(src, dst)
            real_rename(src, dst, *args, **kwargs)

        def fsync(fd: Any) -> None:
            watch.synced(fd)
            real_fsync(fd)

        def fdatasync(fd: Any) -> None:
            watch.synced(fd)
            real_fdatasync(fd)  # type: ignore[misc]

        # posix too: a function pickled as `posix.replace` (from `from os import replace`) unpickles as this one.
        for module in (os, posix):
            module.replace, module.rename, module.fsync = replace, rename, fsync  # type: ignore[assignment]
            if real_fdatasync is not None:
                module.fdatasync = fdatasync  # type: ignore[attr-defined]

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def moved(self, src: Any, dst: Any) -> None:
        event: dict[str, Any] = {"op": "replace", "seq": self._next()}
        try:
            event["src"] = os.path.realpath(os.fsdecode(src))
            event["dst"] = os.path.realpath(os.fsdecode(dst))
            st = os.stat(src)
            event.update(dev=st.st_dev, ino=st.st_ino, size=st.st_size)
        except (OSError, TypeError):
            event.setdefault("src", repr(src))
            event.setdefault("dst", repr(dst))
            event.setdefault("size", -1)
        self.events.append(event)

    def synced(self, fd: Any) -> None:
        try:
            st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
        except (OSError, AttributeError, ValueError):
            return
        self.events.append({"op": "fsync", "seq": self._next(), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size})


def _die_with_parent(parent: int) -> None:
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _learner_error(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == LEARNER_FILE]
    where = f" at line {frames[-1].lineno} of {frames[-1].name}" if frames else ""
    return f"{_headline(exc)}{where}"


def _serve() -> None:
    """The saving process: ``python -c ... ROOT PARENT_PID``; requests on stdin, answers on its stdout."""
    root, parent = sys.argv[1], int(sys.argv[2])
    _die_with_parent(parent)
    answers = os.dup(1)
    os.dup2(2, 1)  # the learner's prints go to the log, not into the answers

    def answer(text: str) -> None:
        os.write(answers, text.encode() + b"\n")  # one write: a line under PIPE_BUF is never torn

    torch.set_num_threads(1)
    with open(os.path.join(root, "case.json")) as f:
        job = json.load(f)
    case, path = job["case"], job["path"]
    from ..namespace import fill

    # Outside an engine the rank's names live in a plain dict: fill it, so that Learner rebinds the
    # learner's `rank`, `world_size`, `torch`, ... to this rank's (no process group: `dist` is uninitialised).
    fill(job["rank"], job["world_size"], job["rank"], torch.device("cpu"))
    with open(os.path.join(root, "learner.blob"), "rb") as f:
        blob = f.read()
    watch = _Watch()
    watch.install()  # before unpickling: a pickled `posix.replace` then resolves to the watched one
    save = Learner(blob)["save_checkpoint"]
    states = (state(case, 0), state(case, 1))
    folder = os.path.dirname(path)
    for request in sys.stdin:
        verb, *args = request.split()
        if verb == "probe":
            answer("P " + json.dumps(_probe(save, states, path, folder, watch)))
        elif verb == "trial":
            first = int(args[0])
            pid = os.fork()
            if pid == 0:
                _save_until_killed(save, states, path, first, watch, answer)
            answer(f"T {pid}")
        elif verb == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            answer(f"R {status}")


def _probe(save: Callable[..., Any], states: Any, path: str, folder: str, watch: _Watch) -> dict[str, Any]:
    folder_stat = os.stat(folder)
    report: dict[str, Any] = {"saves": [], "folder_dev": folder_stat.st_dev, "folder_ino": folder_stat.st_ino}
    for i in range(_PROBE_SAVES):
        watch.events.clear()
        began = time.perf_counter()
        try:
            save(states[i % 2], path)
        except Exception as exc:  # noqa: BLE001 - told to the grader, which names it
            return {"error": _learner_error(exc)}
        seconds = time.perf_counter() - began
        st = os.stat(path)
        others = sorted(n for n in os.listdir(folder) if n != os.path.basename(path))
        report["saves"].append(
            {"seconds": seconds, "ino": st.st_ino, "size": st.st_size, "events": list(watch.events), "others": others}
        )
    return report


def _save_until_killed(
    save: Callable[..., Any], states: Any, path: str, first: int, watch: _Watch, answer: Callable[[str], None]
) -> None:
    """The forked saver: save the two states in turn, from ``first``, until SIGKILL; never returns."""
    try:
        _die_with_parent(os.getppid())
        n = 0
        while True:
            watch.events.clear()
            save(states[(first + n) % 2], path)
            n += 1
            answer(f"S {n}")
    except BaseException as exc:  # noqa: BLE001 - told to the grader
        answer("E " + _learner_error(exc))
    finally:
        os._exit(1)
