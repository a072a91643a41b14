"""The rank's rendezvous store (rank/group.py ``open_store``) leaves nothing behind when it fails."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")

_LISTEN = "0A"  # the TCP state /proc/net/tcp writes for a listening socket


def _listening_sockets() -> set[str]:
    """Inodes of this process's TCP sockets that listen (on IPv4)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:[") : -1])
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.read().splitlines()[1:]]
    return {row[9] for row in rows if row[3] == _LISTEN and row[9] in mine}


def test_a_store_that_fails_to_start_does_not_leak_its_listening_socket(monkeypatch):
    import torch.distributed as dist

    from distlab.rank import group

    real_store = dist.TCPStore

    def store_on_the_wrong_port(host, port, *args, **kwargs):
        # torch's own store, really failing after distlab handed it the socket: it checks that the
        # descriptor is bound to the port it is told, and raises without closing the descriptor.
        return real_store(host, port + 1, *args, **kwargs)

    monkeypatch.setattr(group.dist, "TCPStore", store_on_the_wrong_port)
    before = _listening_sockets()
    with pytest.raises(dist.DistStoreError, match="expected to be bound to port"):
        group.open_store("127.0.0.1", 5.0)
    assert _listening_sockets() == before
