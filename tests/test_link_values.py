"""The values that describe emulated nodes and their links: parsed, printed and checked without a process."""

from __future__ import annotations

import ipaddress

import pytest

from distlab.cluster.nodes import (
    Link,
    Network,
    check_subnet,
    format_duration,
    format_rate,
    parse_duration,
    parse_rate,
    spread,
)
from distlab.errors import LabUsageError


@pytest.mark.parametrize(
    "text, bits",
    [("100mbit", 100_000_000), ("1gbit", 10**9), ("2.5gbit", 2_500_000_000), ("64kbit", 64_000), ("1Gbit", 10**9),
     (" 10 mbit ", 10**7)],
)
def test_rates_read_as_tc_reads_them_si_units_in_bits(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "1gbps", "100", "mbit", "-1mbit", "1 gigabit", 100, None])
def test_a_rate_without_tcs_unit_is_refused_naming_the_units(text):
    with pytest.raises(LabUsageError, match="units: bit, kbit, mbit, gbit, tbit"):
        parse_rate(text)


def test_a_rate_too_small_for_a_token_bucket_is_refused():
    with pytest.raises(LabUsageError, match="at least 8kbit"):
        parse_rate("1kbit")


@pytest.mark.parametrize(
    "value, seconds", [("200us", 200e-6), ("1ms", 1e-3), ("0.5s", 0.5), (0.002, 0.002), ("0ms", 0.0)]
)
def test_durations_in_us_ms_s_or_seconds(value, seconds):
    assert parse_duration(value) == pytest.approx(seconds)


def test_printing_gives_back_the_shortest_spelling():
    assert [format_rate(b) for b in (10**9, 10**8, 2_500_000_000, 64_000, 500)] == [
        "1gbit", "100mbit", "2.5gbit", "64kbit", "500bit"
    ]
    assert [format_duration(s) for s in (200e-6, 1e-3, 2.0)] == ["200us", "1ms", "2s"]
    assert str(Link.parse("1gbit", "200us")) == "1gbit, latency 200us"
    assert Link.parse("1gbit", 0).latency_s is None  # no delay asked: none added


def test_a_subnet_must_hold_the_nodes_and_the_switch():
    assert check_subnet("198.18.4.0/29", 5) == ipaddress.ip_network("198.18.4.0/29")
    with pytest.raises(LabUsageError, match="has room for 6 addresses"):
        check_subnet("198.18.4.0/29", 6)
    with pytest.raises(LabUsageError, match="must be an IPv4 network"):
        check_subnet("198.18.4.1/24", 2)  # an address, not a network


def test_a_networks_addresses_names_and_commands_follow_from_its_subnet():
    net = Network(3, ipaddress.ip_network("198.19.2.0/24"), Link.parse("1gbit"), owner=4242, seq=7)
    assert [net.node_addr(i) for i in range(3)] == ["198.19.2.1", "198.19.2.2", "198.19.2.3"]
    assert net.switch_addr == "198.19.2.254"
    assert net.namespaces() == ["distlab-4242-7-sw", "distlab-4242-7-n0", "distlab-4242-7-n1", "distlab-4242-7-n2"]
    prefix = net.exec_prefix(2)
    assert prefix[:4] == ["ip", "netns", "exec", "distlab-4242-7-n2"] and prefix[-1] == "node2"
    assert net.exec_prefix(None) == ["ip", "netns", "exec", "distlab-4242-7-sw"]


def test_ranks_spread_over_nodes_as_evenly_as_they_can():
    assert spread(4, 2) == [2, 2]
    assert spread(5, 2) == [3, 2]
    assert spread(3, 3) == [1, 1, 1]
    assert spread(3, 1) == [3]


def test_racks_take_their_nodes_in_order_each_with_a_switch_of_its_own():
    net = Network(5, ipaddress.ip_network("198.19.2.0/24"), Link.parse("1gbit"), owner=4242, seq=7,
                  racks=2, uplink=Link.parse("100mbit"))
    assert net.rack_nodes() == [[0, 1, 2], [3, 4]]  # the first rack takes one more, as nodes take ranks
    assert [net.rack_of(i) for i in range(5)] == [0, 0, 0, 1, 1]
    assert net.namespaces()[:3] == ["distlab-4242-7-sw", "distlab-4242-7-r0", "distlab-4242-7-r1"]
    # A node's link ends at its rack's switch.
    assert net._ends()[:2] == [("distlab-4242-7-n0", "eth0"), ("distlab-4242-7-r0", "p0")]
    assert net._uplink_ends() == [("distlab-4242-7-r0", "up0"), ("distlab-4242-7-sw", "r0"),
                                  ("distlab-4242-7-r1", "up0"), ("distlab-4242-7-sw", "r1")]
    line = net.describe()
    assert "5 nodes in 2 racks (rack0: node0 node1 node2, rack1: node3 node4)" in line and "uplink 100mbit" in line
    star = Network(2, ipaddress.ip_network("198.19.2.0/24"), None, owner=4242, seq=8)
    assert star.rack_nodes() == [] and star.rack_of(1) is None and star._uplink_ends() == []
    with pytest.raises(LabUsageError, match="an uplink joins racks"):
        star.set_uplink(Link.parse("1gbit"))
