"""Which urls the router may forward a worker's requests to (design §3 "Who may say hello").

This module owns the rule a hello's `url`, a journaled worker's url, a static
worker's and a spawned worker's port are checked by: loopback or `unix:` unless
`control.allowed_upstreams` lists it; never one of the router's own listeners (a
request forwarded there comes back to the router, and again, until it times out);
and a `unix:` socket only when the worker's own uid owns it or it lies under a
folder of `control.worker_socket_dirs` (the router may run as a user who can open
sockets the worker cannot: forwarding to one for it is a confused deputy).

`url_refusal` is pure; what it needs of the filesystem (where a path really leads
and who owns the socket there) comes from a `SocketLookup`, `look_up_socket` by
default, which reads the file's metadata and nothing else.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from typing import NamedTuple

from router.protocol import (
    UpstreamAddress,
    hosts_clash,
    is_loopback_upstream,
    parse_upstream,
    same_upstream,
)

__all__ = ["SocketFacts", "SocketLookup", "look_up_socket", "url_refusal"]


class SocketFacts(NamedTuple):
    """Where a unix socket path really leads, and who owns the socket there."""

    real_path: str  # symbolic links resolved
    owner: int | None  # the socket file's uid; None when there is no socket there


SocketLookup = Callable[[str], SocketFacts]


def look_up_socket(path: str) -> SocketFacts:
    """The facts of `path`, following links as a connect would."""
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except OSError:
        return SocketFacts(real, None)
    return SocketFacts(real, info.st_uid if stat.S_ISSOCK(info.st_mode) else None)


def url_refusal(
    address: UpstreamAddress,
    *,
    allowed_upstreams: Iterable[str],
    own_listeners: Iterable[UpstreamAddress],
    socket_dirs: Iterable[str],
    owners: frozenset[int] | None,
    look_up: SocketLookup = look_up_socket,
) -> str | None:
    """Why the router must not forward to `address`, as a sentence; None when it may.

    `owners`: the uids whose unix sockets the worker may name (its peer uid, or the
    uids a hello could come from, for a journaled worker); None when no uid is known
    (a hello over TCP), when only `socket_dirs` let a unix socket in.
    """
    if not is_loopback_upstream(address) and not any(
        parse_upstream(allowed) == address for allowed in allowed_upstreams
    ):
        return "The url is not loopback and not in control.allowed_upstreams."
    if any(is_own_listener(address, listener) for listener in own_listeners):
        return "The url is one of the router's own listeners."
    if address.path:
        return _unix_refusal(address.path, socket_dirs, owners, look_up)
    return None


def is_own_listener(address: UpstreamAddress, listener: UpstreamAddress) -> bool:
    """True when a worker url `address` may reach the router's own `listener` (a
    wildcard bind takes every loopback address; names are never resolved)."""
    if listener.path or address.path:
        return same_upstream(address, listener)
    return address.port == listener.port and hosts_clash(
        listener.host, address.host, wildcard_clashes_any=False
    )


def _unix_refusal(
    path: str, socket_dirs: Iterable[str], owners: frozenset[int] | None, look_up: SocketLookup
) -> str | None:
    facts = look_up(path)
    if any(_under(facts.real_path, folder) for folder in socket_dirs):
        return None
    if owners is None:
        return "Over TCP, a unix: url must lie under control.worker_socket_dirs."
    if facts.owner is None:
        return "The unix: url names no socket (a worker listens before it says hello)."
    if facts.owner not in owners:
        return "The unix: socket is not the worker's own, nor under control.worker_socket_dirs."
    return None


def _under(path: str, folder: str) -> bool:
    folder = folder.rstrip("/") or "/"
    return path.startswith(folder if folder == "/" else folder + "/")
