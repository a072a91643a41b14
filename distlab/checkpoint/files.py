"""Checkpoint files on disk: the numbered names :func:`latest` finds, and the atomic write (temporary
file, fsync, rename, fsync of the directory) that leaves either the old file or the new one."""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path

import torch

from ..host import pid_alive as _pid_alive
from ._checks import check_step

# path_for / latest: numbered files, so "the last checkpoint" is the highest number, not the newest mtime.
_NAME = "ckpt-{step:08d}.pt"
_NAME_RE = re.compile(r"ckpt-(\d+)\.pt")
_TEMP_TAG = ".tmp-"  # temporary files are ".<final name>.tmp-<host>-<pid>-<random>": hidden, never matched


# --------------------------------------------------------------------------------------------- names


def path_for(directory: str | os.PathLike[str], step: int) -> Path:
    """``directory/ckpt-00000120.pt`` for step 120: the names :func:`latest` looks for."""
    check_step(step)
    return Path(directory) / _NAME.format(step=step)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the highest step number in ``directory`` (named by :func:`path_for`), or None.

    Every such file is complete (they appear only through an atomic rename); temporary files left by a
    writer that was killed are hidden and never returned. None also when the directory does not exist,
    so ``latest(d)`` reads as "is there anything to resume from?".
    """
    folder = Path(directory)
    if not folder.is_dir():
        return None
    numbered = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME_RE.fullmatch(p.name)) and p.is_file()]
    return max(numbered)[1] if numbered else None


# --------------------------------------------------------------------------------------------- write


def write_atomic(target: Path, payload: Mapping[str, object]) -> None:
    """Temporary file in the same directory (same filesystem, so the rename is atomic), fsync, rename."""
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    host = socket.gethostname()
    temp = directory / f".{target.name}{_TEMP_TAG}{host}-{os.getpid()}-{secrets.token_hex(4)}"
    # os.open applies the umask, so the checkpoint gets the permissions any new file would.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)  # the rename itself survives a power loss


def _remove_stale_temps(target: Path) -> None:
    """Delete temporary files of ``target`` left by writers on this host that are no longer alive."""
    if os.name != "posix":  # os.kill(pid, 0) is a liveness probe only on POSIX
        return
    prefix = f".{target.name}{_TEMP_TAG}{socket.gethostname()}-"
    for leftover in target.parent.glob(f".{target.name}{_TEMP_TAG}*"):
        pid_text = leftover.name[len(prefix):].split("-")[0] if leftover.name.startswith(prefix) else ""
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            leftover.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
