"""The rank-side publisher: rate-limited, and a publish that cannot go out at once is sent later."""

from __future__ import annotations

import threading
import time
from itertools import pairwise

from _jupyter import wait_for

from distlab.telemetry import publish
from distlab.telemetry.publish import KEY, Publisher


def test_the_thread_sends_at_most_once_an_interval():
    sent: list[float] = []
    publisher = Publisher(lambda final: {"final": final}, lambda payload: sent.append(time.monotonic()), 0.2)
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # new data far faster than the interval
            publisher.notify()
            time.sleep(0.005)
        wait_for(lambda: len(sent) >= 3, 2.0, "three sends", poll_s=0.01)
        gaps = [b - a for a, b in pairwise(sent)]
        assert min(gaps) >= 0.19, gaps
        assert len(sent) <= 7  # 1 s of data at one send per 0.2 s, plus the first
    finally:
        publisher.close()


def test_a_final_publish_that_meets_a_stuck_send_is_sent_when_that_send_returns(monkeypatch):
    monkeypatch.setattr(publish, "_SEND_WAIT_S", 0.1)
    in_send, go_on = threading.Event(), threading.Event()
    sent: list[dict] = []

    def send(payload: dict) -> None:
        if not sent and not in_send.is_set():
            in_send.set()
            go_on.wait(5.0)  # the thread's first send hangs (a busy IOPub)
        sent.append(payload[KEY])

    publisher = Publisher(lambda final: {"final": final}, send, 0.05)
    try:
        publisher.notify()
        assert in_send.wait(2.0)
        publisher.flush()  # the cell ends while the thread's send hangs: the flush cannot send now
        assert sent == []
        go_on.set()
        wait_for(lambda: any(p["final"] for p in sent), 2.0, "the owed final publish", poll_s=0.01)
        assert sent[0] == {"final": False} and sent[-1] == {"final": True}
    finally:
        go_on.set()
        publisher.close()
