"""Pure tests for the upstream urls of router.protocol.addresses: what the config's
`workers:` and `allowed_upstreams` and a worker's hello accept, the address each
names, and which two may be one socket."""

from __future__ import annotations

import ipaddress

import pytest

from router.protocol.addresses import (
    UpstreamAddress,
    is_ip,
    is_loopback_upstream,
    parse_upstream,
    same_upstream,
)


@pytest.mark.parametrize(
    ("url", "address", "loopback"),
    [
        ("http://127.0.0.1:9001", UpstreamAddress("", "127.0.0.1", 9001), True),
        ("http://127.0.0.1:09001", UpstreamAddress("", "127.0.0.1", 9001), True),
        ("http://localhost:9001", UpstreamAddress("", "localhost", 9001), True),
        ("http://LocalHost:9001", UpstreamAddress("", "localhost", 9001), True),
        ("http://[::1]:9001", UpstreamAddress("", "::1", 9001), True),
        ("http://[0:0::1]:9001", UpstreamAddress("", "::1", 9001), True),
        ("http://10.0.0.5:9001", UpstreamAddress("", "10.0.0.5", 9001), False),
        ("http://Worker.Internal:9001", UpstreamAddress("", "worker.internal", 9001), False),
        ("unix:/run/worker.sock", UpstreamAddress("/run/worker.sock", "", 0), True),
        ("unix:/run//x/../worker.sock", UpstreamAddress("/run/worker.sock", "", 0), True),
        ("unix:/" + "a" * 106, UpstreamAddress("/" + "a" * 106, "", 0), True),
    ],
)
def test_an_upstream_url_names_one_address(
    url: str, address: UpstreamAddress, loopback: bool
) -> None:
    assert parse_upstream(url) == address
    assert is_loopback_upstream(address) is loopback


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("unix:", "expected http://host:port or unix:/absolute/path"),
        ("unix:run/worker.sock", "expected"),  # relative to whose working directory?
        ("unix:/run/a\x00b", "needs a path"),
        ("unix:/" + "a" * 107, "longer than 107 bytes"),  # sun_path: 108 with its NUL
        ("unix:/tmp/x\ud800.sock", "valid UTF-8"),  # valid JSON (\ud800), yet no path
        ("https://127.0.0.1:9001", "expected"),
        ("ftp://127.0.0.1:9001", "expected"),
        ("http://127.0.0.1", "expected"),
        ("http://127.0.0.1:99999", "expected"),
        ("http://127.0.0.1:0", "expected"),
        ("http://127.0.0.1:port", "expected"),
        ("http://127.0.0.1:9001/", "expected"),  # a hello's trailing slashes are cut first
        ("http://127.0.0.1:9001/path", "expected"),
        ("http://127.0.0.1:9001?q=1", "expected"),
        ("http://127.0.0.1:9001#f", "expected"),
        ("http://user@127.0.0.1:9001", "expected"),
        ("http://:9001", "expected"),
        ("127.0.0.1:9001", "expected"),
        ("http://127.0.0.1:9001\n", "expected"),
        ("http://127.0.0.1:9\t001", "expected"),
        (" http://127.0.0.1:9001", "expected"),
        ("http://127.0.0.1:9001\r\nX-Evil: 1", "expected"),
        ("http://a b:9001", "expected"),
        ("http://\u0661\u0662\u0667.0.0.1:9001", "expected"),  # Arabic-Indic digits
        ("http://127.0.0.1:\u0669001", "expected"),
        ("http://[::1:9001", "expected"),
        ("http://::1:9001", "expected"),  # a v6 address needs its brackets
    ],
)
def test_a_url_that_names_no_address_says_why(url: str, why: str) -> None:
    problem = parse_upstream(url)
    assert isinstance(problem, str)
    assert why in problem


def _address(url: str) -> UpstreamAddress:
    address = parse_upstream(url)
    assert isinstance(address, UpstreamAddress)
    return address


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("http://127.0.0.1:9001", "http://127.0.0.1:9001", True),
        ("http://127.0.0.1:9001", "http://127.0.0.1:09001", True),
        ("http://127.0.0.1:9001", "http://localhost:9001", True),
        ("http://[::1]:9001", "http://LOCALHOST:9001", True),
        ("http://0.0.0.0:9001", "http://127.0.0.1:9001", True),  # connecting to it is local
        ("unix:/run/w.sock", "unix:/run/./w.sock", True),
        ("http://127.0.0.1:9001", "http://127.0.0.1:9002", False),
        ("http://127.0.0.1:9001", "http://127.0.0.2:9001", False),  # another socket
        # Two sockets (design §3 "One address grammar"): a dual-stack server may hold
        # both, two processes one each.
        ("http://127.0.0.1:9001", "http://[::1]:9001", False),
        ("http://localhost:9001", "http://10.0.0.5:9001", False),
        ("http://127.0.0.1:9001", "unix:/run/w.sock", False),
        ("unix:/run/w.sock", "unix:/run/v.sock", False),
    ],
)
def test_two_urls_may_name_one_socket(a: str, b: str, same: bool) -> None:
    assert same_upstream(_address(a), _address(b)) is same
    assert same_upstream(_address(b), _address(a)) is same


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1", "0.0.0.0", "255.255.255.255", "10.1.2.3", "01.2.3.4", "1.2.3.04",
        "256.1.1.1", "1.2.3", "1.2.3.4.5", "1.2.3.4\n", " 1.2.3.4", "1..2.3", "+1.2.3.4",
        "1.2.3.\u0664", "\u0661.2.3.4", "::1", "::ffff:1.2.3.4", "fe80::1%eth0", "1::2::3",
        "[::1]", "", "localhost",
    ],
)  # fmt: skip
def test_is_ip_takes_exactly_the_addresses_ipaddress_takes(host: str) -> None:
    # The dotted quad has a fast path of its own: it must agree with the standard
    # library on every edge (leading zeros, non-ASCII digits, a trailing newline).
    try:
        ipaddress.ip_address(host)
        expected = True
    except ValueError:
        expected = False
    assert is_ip(host) is expected
