"""Network namespaces for the fleet tests: each router on a host of its own, and links
that can go down for real (`ip link set down`: packets dropped, no close, no refusal).

A bridge in this namespace holds the gateway address, where the test's redis-server
listens; each router runs in a namespace of its own (`ip netns exec`) on a veth pair
whose far end is on the bridge, with an address of the test's subnet. Taking the
bridge end of a router's pair down cuts it off from Redis and from every peer at once,
as a node falling off the network does. Every name the test creates carries a random
tag, and the test deletes exactly what it created (the namespaces once their processes
are stopped, then the bridge). Creating them needs root and iproute2; without them the
test fails and says so.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import shutil
import subprocess

import pytest

from tests.fleet.rig import Placement

COMMAND_TIMEOUT_S = 10.0


def ip(*argv: str) -> None:
    """Run `ip argv...`; AssertionError with its stderr when it fails."""
    found = shutil.which("ip")
    if found is None:
        pytest.fail("iproute2's `ip` is not installed: the partition tests need it")
    done = subprocess.run([found, *argv], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, f"ip {' '.join(argv)}: {done.stderr.strip()}"


class Network:
    """A bridge here and one namespace per router on it (see the module docstring)."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)  # interface names are at most 15 characters
        self.subnet = f"10.213.{random.randrange(1, 255)}"
        self.bridge = f"erb{self.tag}"
        self.gateway = f"{self.subnet}.1"
        self.namespaces: list[str] = []
        self._created_bridge = False

    def create(self) -> None:
        try:
            ip("link", "add", self.bridge, "type", "bridge")
        except AssertionError as exc:
            pytest.fail(f"cannot create a bridge (the partition tests need root): {exc}")
        self._created_bridge = True
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def host_end(self, index: int) -> str:
        return f"erh{self.tag}{index}"

    def add(self, index: int) -> Placement:
        """Namespace `index` (0-based) on the bridge, its loopback up: where router
        index + 1 runs."""
        namespace = f"er-{self.tag}-{index}"
        ip("netns", "add", namespace)
        self.namespaces.append(namespace)
        inner, address = f"ern{self.tag}{index}", f"{self.subnet}.{10 + index}"
        ip("link", "add", self.host_end(index), "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", namespace)
        ip("link", "set", self.host_end(index), "master", self.bridge, "up")
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inner)
        ip("-n", namespace, "link", "set", inner, "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        return Placement(address, ("ip", "netns", "exec", namespace))

    def cut(self, index: int) -> None:
        """Router index + 1 falls off the network: its packets are dropped both ways."""
        ip("link", "set", self.host_end(index), "down")

    def mend(self, index: int) -> None:
        ip("link", "set", self.host_end(index), "up")

    def remove(self) -> None:
        """Delete what `create` and `add` made (a namespace takes its veth pair along);
        never raises, so each gets its turn."""
        for namespace in self.namespaces:
            with contextlib.suppress(AssertionError, subprocess.SubprocessError):
                ip("netns", "del", namespace)
        if self._created_bridge:
            with contextlib.suppress(AssertionError, subprocess.SubprocessError):
                ip("link", "del", self.bridge)
