"""Opening the directory's Redis client: standalone Redis by URL, or a primary under Sentinel.

redis-py's asyncio client, with hiredis parsing replies when it is installed (a
dependency of the package). Standalone: `redis://host:port/db`, `rediss://...`, or
`unix:/path` (a Unix socket, the form the router's other addresses use). Sentinel:
the master's name and the sentinels' `host:port` list; the client asks them for the
current primary, and again after a failover.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel

# Socket-level bounds under the calls' own deadlines: a connect that hangs (a dropped
# SYN) fails here rather than holding a connection slot. 2 s, as claim_timeout_s.
CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """A primary found through Sentinel: its master name and the sentinels."""

    master: str
    nodes: tuple[tuple[str, int], ...]
    db: int = 0


def redis_url(address: str) -> str:
    """redis-py's URL for a directory address: `unix:/path` becomes `unix:///path`;
    `redis://` and `rediss://` pass. Raises ValueError for anything else."""
    if address.startswith("unix:") and not address.startswith("unix://"):
        path = address[len("unix:") :]
        if not path.startswith("/"):
            raise ValueError(f"a directory socket path is absolute: {address!r}")
        return "unix://" + path
    if address.startswith(("redis://", "rediss://", "unix://")):
        return address
    raise ValueError(f"a directory address is redis://, rediss:// or unix:/path, not {address!r}")


def sentinel_nodes(nodes: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """`["host:port", ...]` as pairs; raises ValueError for a malformed one."""
    pairs: list[tuple[str, int]] = []
    for node in nodes:
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a sentinel is host:port, not {node!r}")
        pairs.append((host.strip("[]"), int(port)))
    if not pairs:
        raise ValueError("a sentinel setup names at least one sentinel")
    return tuple(pairs)


def open_redis(target: str | SentinelTarget, password: str | None = None) -> Redis:
    """A client for `target` (AUTH with `password` when given); it connects on its
    first command."""
    if isinstance(target, SentinelTarget):
        # redis-py types Sentinel's constructor from 8.2 on and not before (the package
        # takes >= 5.0): the ignore serves the older ones and is unused on the newer.
        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            list(target.nodes),
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            sentinel_kwargs={"socket_connect_timeout": CONNECT_TIMEOUT_S},
        )
        primary: Redis = sentinel.master_for(
            target.master,
            db=target.db,
            decode_responses=True,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            password=password,
        )
        return primary
    return Redis.from_url(
        redis_url(target),
        decode_responses=True,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        password=password,
    )
