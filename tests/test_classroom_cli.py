"""``python -m distlab.classroom hub``: refusals in one line that change nothing, and a class started and stopped."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from distlab.classroom.__main__ import main, memory_bytes


def test_memory_sizes_read_as_jupyterhub_reads_them() -> None:
    assert memory_bytes("4G") == 4 * 2**30
    assert memory_bytes("512M") == 512 * 2**20
    assert memory_bytes("1.5g") == int(1.5 * 2**30)
    assert memory_bytes("1000") == 1000
    for bad in ("4Q", "", "-1G", "G"):
        with pytest.raises(ValueError, match="--memory"):
            memory_bytes(bad)


@pytest.mark.parametrize(("argv", "said"), [
    (["--ranks", "0"], "limit ranks='0' must be a whole number >= 1"),
    (["--idle", "soon"], "idle"),
    (["--memory", "lots"], "--memory 'lots' is not a size"),
    (["--learners", "dl-no-such-learner"], "dl-no-such-learner is not a user of this machine: sudo useradd -m"),
    (["--notebooks", "/no/such/folder"], "--notebooks /no/such/folder: no such folder"),
])
def test_a_class_that_cannot_start_is_refused_in_one_line_and_nothing_is_written(
    argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "class"
    args = ["hub", "--learners", "root", "--dir", str(state), *argv]
    if argv[0] == "--learners":
        args = ["hub", "--dir", str(state), *argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert all(line.startswith("error: ") for line in err.splitlines())
    assert not state.exists()


@pytest.mark.e2e
def test_the_hub_command_runs_a_class_until_interrupted_and_leaves_nothing(tmp_path: Path) -> None:
    from _hub import learner_python, make_user, remove_user, skip_unless_possible
    from _jupyter import free_port, wait_for

    system_python = skip_unless_possible()
    import shutil
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="distlab-hub-", dir="/tmp"))
    shared.chmod(0o755)
    learner = "dl-cli"
    port = free_port()

    def hub_addresses() -> set[str]:  # other hubs (other test files) may hold theirs meanwhile
        lo = subprocess.run(["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=True)
        return {line.split()[3] for line in lo.stdout.splitlines() if " 198.19.24" in line}

    try:
        python = learner_python(shared, system_python)
        make_user(learner)
        log_path = tmp_path / "hub.log"
        log = open(log_path, "w")  # noqa: SIM115 - closed below
        hub = subprocess.Popen(
            [sys.executable, "-m", "distlab.classroom", "hub", "--learners", learner, "--ranks", "2", "--idle", "20m",
             "--cores", "1", "--port", str(port), "--dir", str(tmp_path / "class"), "--python", python,
             "--authenticator", "dummy"],
            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )

        def answers() -> bool:
            assert hub.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/hub/api/", timeout=5) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_for(answers, 120, "the class's hub to answer")
        config = (tmp_path / "class" / "jupyterhub_config.py").read_text()
        assert "'limits': 'ranks=2,idle=20m'" in config and "'cores': 1.0" in config, config
        import re

        found = re.search(r"Hub API listening on http://([\d.]+):", log_path.read_text())
        assert found, log_path.read_text()[-3000:]
        claimed = {found.group(1) + "/32"}
        assert claimed <= hub_addresses()
        # Another test's hub may claim the same address the moment this one lets it go, so what
        # is on loopback afterwards proves nothing: the kernel's own record of the release does.
        with _address_events() as events:
            hub.send_signal(signal.SIGINT)
            assert hub.wait(timeout=60) == 0
        log.close()
        out = log_path.read_text()
        assert "1 learners, 0 instructors; limits ranks=2,idle=20m, cores 1.0" in out, out
        released = [line for line in events if line.startswith("Deleted") and f" inet {found.group(1)}/32 " in line]
        assert released, events
    finally:
        remove_user(learner)
        shutil.rmtree(shared, ignore_errors=True)


@contextlib.contextmanager
def _address_events() -> Iterator[list[str]]:
    """The address changes on loopback while the block runs (``ip monitor``), as its lines. The
    monitor is known to listen before the block starts: an address of its own (198.18.0.0/15, for
    benchmarks, unused here) is added and removed, and the block waits until it has seen both."""
    probe = "198.18.255.254/32"
    lines: list[str] = []
    monitor = subprocess.Popen(["ip", "-o", "monitor", "address", "dev", "lo"], stdout=subprocess.PIPE, text=True)
    out = monitor.stdout
    assert out is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(out.readline, "")), daemon=True)
    reader.start()
    try:
        from _jupyter import wait_for

        def seen() -> bool:
            subprocess.run(["ip", "addr", "add", probe, "dev", "lo"], capture_output=True, check=False)
            subprocess.run(["ip", "addr", "del", probe, "dev", "lo"], capture_output=True, check=False)
            return any(line.startswith("Deleted") and f" {probe} " in line for line in lines)

        wait_for(seen, 30, "ip monitor to listen")
        yield lines
    finally:
        monitor.terminate()
        monitor.wait(timeout=10)
        reader.join(timeout=10)
