"""Loopback ports for the tests' servers, from below the kernel's ephemeral range.

A port found by binding port 0 comes from the range outgoing connections take theirs
from: the tests make thousands of connections, and one of them (or another server's
bind to port 0) can take the port between the check and the server's own bind, or
while a server that was killed or not yet started is down. A test met it: a Redis the
test starts later found an HTTP worker on its port. So every port here comes from
below that range, and none is handed out twice in one run.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
PORTS_FROM = 20000  # the first port handed out


def _ephemeral_low() -> int:
    """Where the kernel's range for outgoing connections starts."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORTS_TO = max(_ephemeral_low(), PORTS_FROM + 10000)  # a range starting low: share it
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nothing listens on, outside the ephemeral range."""
    return free_port_range(1)


def free_port_range(count: int) -> int:
    """The first of `count` consecutive loopback ports nothing listens on (each is bound
    once to check it, then released), outside the ephemeral range."""
    for _ in range(200):
        base = random.randrange(PORTS_FROM, PORTS_TO - count)
        ports = range(base, base + count)
        if _handed_out.isdisjoint(ports) and all(_bindable(port) for port in ports):
            _handed_out.update(ports)
            return base
    raise AssertionError(f"no {count} consecutive free loopback ports found")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True
