"""distlab/ipycompat.py: the private ipyparallel, ipykernel and ipywidgets APIs distlab uses, gated by version.

The version gate is a pure function of the version string; each compat function runs against the
packages really installed (a real cluster where it needs one), and a missing attribute fails loudly.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ipywidgets
import pytest
import tomllib
import yaml

from distlab import ipycompat, ipycompat_engine, ipycompat_widgets
from distlab.errors import DistlabError

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------- the version gate


@pytest.mark.parametrize(("package", "version"), [
    ("ipyparallel", "9.3.0"), ("ipyparallel", "10.0.1"), ("ipyparallel", "8.8.0"),
    ("ipykernel", "6.29.5"), ("ipykernel", "7.5.0"), ("ipywidgets", "8.2.0"), ("ipywidgets", "7.8.5"),
    ("ipyparallel", "unknown"),
])
def test_a_version_outside_those_run_is_refused_in_one_line_naming_package_version_and_fix(package, version):
    problem = ipycompat.version_problem(package, version)
    assert problem is not None and "\n" not in problem
    assert f"this is {package} {version}" in problem
    low, high = ipycompat.KNOWN_GOOD[package]
    assert f"pip install '{package}>={low[0]}.{low[1]},<{high[0]}.{high[1]}'" in problem
    with pytest.raises(DistlabError, match=re.escape(problem)):
        ipycompat.check_version(package, version)


@pytest.mark.parametrize(("package", "version"), [
    ("ipyparallel", "9.2.0"), ("ipyparallel", "9.2.7.dev0"), ("ipykernel", "7.4.0"), ("ipywidgets", "8.1.9"),
])
def test_a_version_among_those_run_passes(package, version):
    assert ipycompat.version_problem(package, version) is None
    ipycompat.check_version(package, version)


@pytest.mark.parametrize("package", sorted(ipycompat.KNOWN_GOOD))
def test_the_installed_release_is_one_of_those_run(package):
    module = __import__(package)
    assert ipycompat.version_problem(package, module.__version__) is None


def _bounds(specs: list[str], package: str) -> str:
    return next(re.sub(r"\s", "", s[len(package):]) for s in specs if re.match(rf"{package}\s*[<>=]", s))


@pytest.mark.parametrize("package", sorted(ipycompat.KNOWN_GOOD))
def test_pyproject_and_binder_admit_exactly_the_releases_the_gate_does(package):
    low, high = ipycompat.KNOWN_GOOD[package]
    expected = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert _bounds(project["dependencies"], package) == expected
    binder = yaml.safe_load((REPO / "binder" / "environment.yml").read_text())
    assert _bounds([d for d in binder["dependencies"] if isinstance(d, str)], package) == expected


# ----------------------------------------------------------------- missing attributes, loudly


def test_a_client_without_the_control_request_ipyparallel_had_fails_loudly_not_silently():
    class RenamedUpstream:  # an ipyparallel whose Client lost _send_control_request
        ids = (0,)

    with pytest.raises(DistlabError, match=r"^ipyparallel 9\.2\.\S+ has no RenamedUpstream\._send_control_request, "
                                           r"which distlab uses to send a control request to an engine: install"):
        ipycompat.control_request(RenamedUpstream(), [0], "distlab_release_request", {}, 0.1)


def test_a_client_without_its_iopub_internals_fails_loudly():
    with pytest.raises(DistlabError, match=r"has no object\._dispatch_iopub, which distlab uses to guard"):
        ipycompat.wrap_iopub_dispatch(object(), lambda dispatch: dispatch, 0.1)


def test_an_ipywidgets_without_send_is_refused_when_a_counted_widget_class_is_made(monkeypatch):
    monkeypatch.delattr(ipywidgets.Widget, "_send")  # as a release that renamed it would be
    with pytest.raises(DistlabError, match=r"^ipywidgets 8\.1\.\S+ has no Widget\._send, which distlab uses to count"):
        class Counted(ipycompat_widgets.CountedSends, ipywidgets.Label):  # made only to be refused
            pass


def test_a_slurm_launcher_is_refused_in_one_line_when_ipyparallel_lacks_its_command_runner(monkeypatch):
    from ipyparallel.cluster import launcher

    from distlab.ipycompat_launchers import SlurmLauncherHooks

    monkeypatch.delattr(launcher.BatchSystemLauncher, "_run_command")  # as a release that renamed it would be
    with pytest.raises(DistlabError, match=r"^ipyparallel 9\.2\.\S+ has no SlurmEngineSetLauncher\._run_command, "
                                           r"which distlab uses to submit to Slurm"):
        class Slurm(SlurmLauncherHooks):  # made only to be refused
            pass


# ----------------------------------------------------------- against the installed packages


def test_a_counted_widget_counts_each_message_it_sends():
    class CountedLabel(ipycompat_widgets.CountedSends, ipywidgets.Label):
        pass

    label = CountedLabel(value="a")
    before = ipycompat_widgets.widget_messages_sent(label)
    label.value = "b"
    label.value = "c"
    label.value = "c"  # no change: nothing sent
    assert ipycompat_widgets.widget_messages_sent(label) == before + 2


def test_outside_an_engine_and_a_kernel_nothing_is_served_and_no_engine_is_seen():
    engine_module_loaded = "ipyparallel.engine.kernel" in sys.modules
    assert ipycompat_engine.on_engine() is False
    assert ("ipyparallel.engine.kernel" in sys.modules) == engine_module_loaded  # not imported to find out
    assert ipycompat_engine.serve_control_request("distlab_test_ping", "distlab_test_pong", dict) is False


def _stop(made: Any) -> None:
    """Stop a cluster these tests made with ipyparallel alone, and remove the files it wrote: its hub's
    engine-state file (``engines<id>.json`` in the profile's log) outlives ipyparallel's stop, which a
    lab's stop removes itself (``ProcessGuard.end_all``)."""
    from distlab.cluster.processes import remove_files

    files = ipycompat.cluster_files(made)
    made.stop_cluster_sync()
    remove_files(files)
    assert not [path for pattern in files for path in glob.glob(pattern)], files


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, Any]]:
    """A real ipyparallel cluster of one engine, started as distlab starts a lab's, and its client."""
    from distlab.cluster.launch import engine_start_args, make_cluster

    made = make_cluster(1, "local", local=True, timeout_s=60)
    try:
        made.start_controller_sync()
        made.start_engines_sync(**engine_start_args(True))
        client = made.connect_client_sync()
        client.wait_for_engines(1, timeout=120, block=True, interactive=False)
        yield made, client
    finally:
        _stop(made)


# Runs on the engine, as distlab's rank code does: serve a control message of our own.
_SERVE_PING = """
import os
from distlab import ipycompat_engine
served = ipycompat_engine.serve_control_request("distlab_test_ping", "distlab_test_pong",
                                         lambda asked: {"status": "ok", "pid": os.getpid(), "asked": asked})
"""


@pytest.mark.cluster
def test_a_control_request_of_our_own_is_served_on_the_engine_and_answered(cluster):
    _, client = cluster
    engine = client[client.ids[0]]
    engine.execute(_SERVE_PING, block=True)
    assert engine.pull("served", block=True) is True
    replies = ipycompat.control_request(client, [client.ids[0]], "distlab_test_ping", {"word": "hello"}, 30)
    assert replies is not None
    [reply] = replies
    assert reply["msg_type"] == "distlab_test_pong"
    # The answer is given the request's content: what the pause's words (step, read) travel in.
    assert reply["content"] == {"status": "ok", "pid": engine.apply_sync(os.getpid), "asked": {"word": "hello"}}


@pytest.mark.cluster
def test_a_control_request_nobody_answers_gives_none_and_an_unknown_engine_too(cluster):
    _, client = cluster
    assert ipycompat.control_request(client, [client.ids[0]], "distlab_nobody_serves_this", {}, 0.5) is None
    assert ipycompat.control_request(client, [max(client.ids) + 100], "distlab_test_ping", {}, 0.5) is None


@pytest.mark.cluster
def test_a_call_sent_straight_to_one_engine_comes_back_with_its_result(cluster):
    from ipyparallel.client.asyncresult import AsyncResult

    _, client = cluster
    engine_id = client.ids[0]
    socket, identity, targets = ipycompat.engine_send_target(client, engine_id)
    future = client.send_apply_request(socket, os.getpid, (), {}, ident=identity)
    reply = AsyncResult(client, future, fname="getpid", targets=targets, owner=True)
    assert targets == [engine_id]
    assert reply.get(timeout=60) == client[engine_id].apply_sync(os.getpid)


@pytest.mark.cluster
def test_an_engine_knows_it_is_one(cluster):
    _, client = cluster
    engine = client[client.ids[0]]
    engine.execute("from distlab import ipycompat_engine; seen = ipycompat_engine.on_engine()", block=True)
    assert engine.pull("seen", block=True) is True


@pytest.mark.cluster
def test_the_launchers_pids_are_the_controllers_and_the_engines(cluster):
    made, client = cluster
    pids = ipycompat.launcher_pids(made)
    engine_pid = client[client.ids[0]].apply_sync(os.getpid)
    assert engine_pid in pids
    assert made.controller.process.pid in pids
    assert all(isinstance(p, int) and p > 0 for p in pids)


@pytest.mark.cluster
def test_the_controllers_connection_files_are_found(cluster):
    made, _ = cluster
    for kind in ("client", "engine"):
        with open(ipycompat.controller_connection_file(made, kind)) as f:
            info = json.load(f)
        assert "registration" in info and "location" in info


@pytest.mark.cluster
def test_a_wrapped_iopub_dispatch_sees_every_message_and_output_still_arrives(cluster):
    _, client = cluster
    seen: list[Any] = []

    def counting(dispatch: Any) -> Any:
        def on_recv(parts: Any) -> None:
            seen.append(parts)
            dispatch(parts)

        return on_recv

    ipycompat.wrap_iopub_dispatch(client, counting, timeout_s=30)
    ar = client[client.ids[0]].execute("print('through the wrapper')", block=False)
    ar.get(timeout=60)
    ar.wait_for_output(timeout=30)
    assert "through the wrapper" in ar.stdout
    assert seen


def test_releasing_stuck_ranks_through_a_client_that_lost_the_control_request_raises_not_frees_nothing():
    # Before ipycompat, the release request sat under a broad suppress: a rename upstream made
    # releasing stuck ranks silently do nothing, and the ranks were then killed instead.
    from distlab.notebook.release import Releaser
    from distlab.notebook.world import RankInfo

    class RenamedUpstream:
        ids = (7,)

    releaser = Releaser()
    releaser.listen(RenamedUpstream(), [], timeout_s=1)
    stuck = RankInfo(rank=0, engine_id=7, host="h", pid=1, local_rank=0, device="cpu", backend="gloo", addr="a")
    with pytest.raises(DistlabError, match=r"has no RenamedUpstream\._send_control_request"):
        releaser.release([stuck])


@pytest.mark.cluster
def test_an_engine_registering_while_a_client_connects_is_counted_though_ipyparallel_misses_it(monkeypatch):
    # ipyparallel's client asks the hub which engines are registered, then subscribes to the
    # notifications of new ones: an engine registering in between is in neither. Here it is made
    # to register exactly then (warm engines registered that fast: a start waited 30 s for them).
    import glob

    import ipyparallel as ipp
    import zmq
    from ipyparallel import util

    from distlab.cluster.launch import engine_start_args, make_cluster
    from distlab.cluster.processes import wait_for

    made = make_cluster(1, "local", local=True, timeout_s=60)
    real_connect = util.connect
    subscribed: list[str] = []

    def registered() -> bool:  # the hub writes its engines down once an engine's registration finished
        for path in glob.glob(os.path.join(made.profile_dir, "log", f"engines{made.cluster_id}.json")):
            with open(path) as f:
                return bool(json.load(f).get("engines"))
        return False

    def connect(socket: Any, url: str, *args: Any, **kwargs: Any) -> Any:
        if socket.type == zmq.SUB and not subscribed:  # the notifications: after the hub's answer
            subscribed.append(url)
            made.start_engines_sync(1, **engine_start_args(True))
            assert wait_for(registered, 60), "the engine did not register"
        return real_connect(socket, url, *args, **kwargs)

    try:
        made.start_controller_sync()
        connection_file = ipycompat.controller_connection_file(made, "client")
        assert wait_for(lambda: os.path.exists(connection_file), 60), "the controller wrote no connection file"
        monkeypatch.setattr(util, "connect", connect)
        client = ipp.Client(connection_file, cluster=made)
        monkeypatch.setattr(util, "connect", real_connect)
        try:
            assert subscribed and client.ids == []  # what ipyparallel alone would wait on forever
            _one_engine_counted_and_reachable(client)
        finally:
            client.close()
    finally:
        _stop(made)


@pytest.mark.cluster
def test_an_engine_that_finds_the_connection_file_still_empty_waits_for_it_instead_of_dying():
    # The controller writes its connection file in place: an engine that opens it between the
    # open and the write reads nothing (a loaded machine did; the lab then waited out its timeout).
    # Here the file is kept empty for a second while the engine starts.
    import ipyparallel as ipp

    from distlab.cluster.launch import engine_start_args, make_cluster
    from distlab.cluster.processes import wait_for

    made = make_cluster(1, "local", local=True, timeout_s=60)
    try:
        made.start_controller_sync()
        engine_file = ipycompat.controller_connection_file(made, "engine")
        assert wait_for(lambda: os.path.exists(engine_file) and os.path.getsize(engine_file) > 0, 60)
        whole = Path(engine_file).read_text()
        Path(engine_file).write_text("")  # as the controller's open(path, "w") leaves it
        made.start_engines_sync(1, **engine_start_args(True))
        sets = list(made.engines)
        looked = lambda: any("Loading connection file" in out for _, _, out in ipycompat.engine_states(made, sets))  # noqa: E731
        assert wait_for(looked, 60), ipycompat.engine_states(made, sets)
        Path(engine_file).write_text(whole)  # the controller's write
        client = ipp.Client(ipycompat.controller_connection_file(made, "client"), cluster=made)
        try:
            _one_engine_counted_and_reachable(client, made, sets)
        finally:
            client.close()
    finally:
        _stop(made)


def _one_engine_counted_and_reachable(client: Any, cluster: Any = None, sets: list[str] | None = None) -> None:
    """The start's wait counts the one engine (as id 0), and a cell runs on it."""
    from distlab.cluster.launch import wait_for_engines

    wait_for_engines(client, 1, timeout_s=30, cluster=cluster, sets=sets)
    assert client.ids == [0]
    # The reply, under a deadline: execute(block=True) would also wait, with none, for the iopub
    # messages that say its output ended, which a loaded run once never delivered.
    client[0].execute("answer = 6 * 7", block=False).get(timeout=60)
    assert client[0].pull("answer", block=False).get(timeout=60) == 42
