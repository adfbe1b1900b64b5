"""The config's address checks: upstream urls, the control socket, listener clashes.

This module owns what the configuration refuses of an address: a worker url or a
control socket the protocol's grammar (`router.protocol.addresses`) does not read, a
tcp:// control socket off loopback, and two listeners (or spawned ports) on one
address, or a static worker sitting on one of them.

It must never resolve a name, open a socket or bind a port: every check reads the
text alone.
"""

from __future__ import annotations

import posixpath
from typing import NamedTuple

from router.config.errors import quote
from router.config.model import Config
from router.config.reader import Context
from router.protocol import (
    HTTP,
    TCP,
    hosts_clash,
    is_loopback_host,
    parse_upstream,
    read_control_address,
    split_host_port,
)


def is_tcp_socket(spec: str) -> bool:
    """True for a `tcp://` control socket spec (else it is a `unix:` one, once checked).

    The one test of a socket's kind: a reload that moves the socket to the other
    kind and the config check must never disagree about a spec.
    """
    return spec.startswith(TCP)


def upstream_problem(url: str) -> str | None:
    """Why `url` is not "http://host:port" or "unix:/absolute/path", or None."""
    parsed = parse_upstream(url)
    return parsed if isinstance(parsed, str) else None


def control_socket_problem(spec: str) -> str | None:
    """Why `spec` cannot be the control socket, or None: the grammar's reason, or a
    tcp:// socket off loopback."""
    parsed = read_control_address(spec)
    if isinstance(parsed, str):
        return parsed
    if parsed.scheme == "tcp" and not is_loopback_host(parsed.host):
        return (
            f"a tcp:// control socket must be on loopback (127.0.0.0/8, ::1, localhost), "
            f"got {quote(parsed.host)}: the control protocol is not encrypted"
        )
    return None


class _Bound(NamedTuple):
    """A port range the router binds or starts a process on."""

    key_path: str
    host: str
    first: int
    last: int


def _bound_ranges(config: Config) -> list[_Bound]:
    bound = [
        _Bound("listen.port", config.listen.host, config.listen.port, config.listen.port),
        _Bound("admin.port", config.admin.host, config.admin.port, config.admin.port),
    ]
    tcp = config.control.tcp_address
    if tcp is not None:
        bound.append(_Bound("control.socket", tcp[0], tcp[1], tcp[1]))
    if config.peer is not None:
        peer = config.peer
        bound.append(_Bound("peer.listen", peer.host, peer.port, peer.port))
    if config.spawn is not None:
        spawn = config.spawn
        last = spawn.base_port + spawn.count - 1
        bound.append(_Bound("spawn.base_port", spawn.host, spawn.base_port, last))
    return [b for b in bound if b.first != 0]  # port 0: the kernel picks a free port


def check_addresses(ctx: Context, config: Config) -> None:
    """No two listeners (or spawned ports) on one address, and no worker at one of them."""
    bound = _bound_ranges(config)
    for i, later in enumerate(bound):
        for earlier in bound[:i]:
            ports = earlier.first <= later.last and later.first <= earlier.last
            if ports and hosts_clash(earlier.host, later.host, wildcard_clashes_any=True):
                raise ctx.fail(later.key_path, f"address clashes with {earlier.key_path}")
    for i, worker in enumerate(config.workers):
        if not worker.url.startswith(HTTP):
            continue
        host, port = split_host_port(worker.url[len(HTTP) :]) or ("", 0)
        for b in bound:
            clash = hosts_clash(b.host, host, wildcard_clashes_any=False)
            if clash and b.first <= port <= b.last:
                raise ctx.fail(f"workers[{i}].url", f"is the router's own {b.key_path} address")
    control_path = config.control.unix_path
    for i, worker in enumerate(config.workers):
        address = parse_upstream(worker.url)
        if control_path is None or isinstance(address, str) or not address.path:
            continue
        if address.path == posixpath.normpath(control_path):
            raise ctx.fail(f"workers[{i}].url", "is the router's own control.socket")
