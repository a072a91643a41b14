"""The rank's one publisher: rate-limited for the rank and for each source, a watch's telemetry and tqdm's
bars in the same publishes, and a final publish that cannot go out at once is sent later."""

from __future__ import annotations

import threading
import time
from itertools import pairwise

from _jupyter import wait_for

from distlab.rank import publish
from distlab.rank.publish import Publisher
from distlab.records import PUBLISH_KEY
from distlab.wire import PROGRESS_KEY


def test_the_thread_sends_at_most_once_an_interval():
    sent: list[float] = []
    publisher = Publisher(lambda payload: sent.append(time.monotonic()), 0.2)
    source = publisher.source(PUBLISH_KEY, lambda final: {"final": final})
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # new data far faster than the interval
            source.notify()
            time.sleep(0.005)
        wait_for(lambda: len(sent) >= 3, 2.0, "three sends", poll_s=0.01)
        gaps = [b - a for a, b in pairwise(sent)]
        assert min(gaps) >= 0.19, gaps
        assert len(sent) <= 7  # 1 s of data at one send per 0.2 s, plus the first
        assert source.sent == len(sent)
    finally:
        publisher.close()


def test_telemetry_and_progress_share_the_ranks_rate_limit_each_at_its_own_interval():
    sent: list[tuple[float, dict]] = []
    publisher = Publisher(lambda payload: sent.append((time.monotonic(), dict(payload))), 0.1)
    steps = publisher.source(PUBLISH_KEY, lambda final: {"final": final}, 0.3)  # a watch's publish_interval_s
    bars = publisher.source(PROGRESS_KEY, lambda final: {"bars": []})  # the rank's interval
    try:
        end = time.monotonic() + 1.2
        while time.monotonic() < end:  # both change far faster than either interval
            # Both marked at once: on a loaded machine the thread could otherwise run between the two
            # calls and find only the steps new (then rightly sends them alone), which is the test's
            # race, not the publisher's.
            with publisher._wake:
                steps.notify()
                bars.notify()
            time.sleep(0.005)
        wait_for(lambda: steps.sent >= 3, 2.0, "three telemetry publishes", poll_s=0.01)
    finally:
        publisher.close()
    times = [t for t, _ in sent]
    # One publish_data a rank per 0.1 s, whichever sources it carries ...
    assert min(b - a for a, b in pairwise(times)) >= 0.09
    # ... and the watch's steps once per its own 0.3 s, riding in publishes that also carry the bars.
    step_times = [t for t, payload in sent if PUBLISH_KEY in payload]
    assert min(b - a for a, b in pairwise(step_times)) >= 0.29
    assert all(PROGRESS_KEY in payload for _, payload in sent)
    assert len(step_times) < len(sent), "the bars went out between the steps' publishes"


def test_a_final_publish_that_meets_a_stuck_send_is_sent_when_that_send_returns(monkeypatch):
    monkeypatch.setattr(publish, "_SEND_WAIT_S", 0.1)
    in_send, go_on = threading.Event(), threading.Event()
    sent: list[dict] = []

    def send(payload: dict) -> None:
        if not sent and not in_send.is_set():
            in_send.set()
            go_on.wait(5.0)  # the thread's first send hangs (a busy IOPub)
        sent.append(payload[PUBLISH_KEY])

    publisher = Publisher(send, 0.05)
    source = publisher.source(PUBLISH_KEY, lambda final: {"final": final}, keep_final=True)
    try:
        source.notify()
        assert in_send.wait(2.0)
        assert not source.flush()  # the cell ends while the thread's send hangs: the flush cannot send now
        assert sent == []
        go_on.set()
        wait_for(lambda: any(p["final"] for p in sent), 2.0, "the owed final publish", poll_s=0.01)
        assert sent[0] == {"final": False} and sent[-1] == {"final": True}
    finally:
        go_on.set()
        publisher.close()


def test_a_source_with_nothing_to_say_at_the_cells_end_sends_nothing():
    sent: list[dict] = []
    publisher = Publisher(sent.append)
    quiet = publisher.source(PROGRESS_KEY, lambda final: None)  # no bar moved in the cell
    try:
        assert quiet.flush() and sent == [] and quiet.sent == 0
    finally:
        publisher.close()


def test_a_send_that_raises_stops_every_source_and_says_why():
    def send(payload: dict) -> None:
        raise ConnectionError("iopub closed")

    publisher = Publisher(send)
    steps = publisher.source(PUBLISH_KEY, lambda final: {"final": final})
    bars = publisher.source(PROGRESS_KEY, lambda final: {"bars": []})
    try:
        steps.flush()
        assert steps.error == bars.error == "ConnectionError: iopub closed"
        assert steps.sent == bars.sent == 0
    finally:
        publisher.close()
