"""The control protocol's wire format on the worker side (DESIGN §3): pure line helpers.

This module owns what a worker needs to speak the protocol: its version and
limits, the control address syntax (`unix:/path` or `tcp://host:port`), NDJSON
line encoding and reply decoding, the hello message and which refusals of it are
final, splitting a worker's claims into `sync` messages that stay under the line
limit, and reading the refusals a sync reply lists. `router.client` re-exports
the public names.

It is pure: it must never import asyncio or aiohttp, open a socket, or log.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

PROTOCOL_VERSION = 1
# The contract's line limit; the router closes a connection that sends a longer line.
MAX_LINE_BYTES = 1 << 20
# The contract's cap on claims per sync message.
SYNC_BATCH_CLAIMS = 1000

Reply = dict[str, object]

# The hello refusals no retry can change: the router's policy refuses this worker's
# secret, uid or url (`forbidden`, until an operator changes the policy), or the
# hello itself (`unsupported_version`, `bad_request`). Any other (`worker_busy`:
# another live process has this worker id or url, or the config names the id as a
# static worker's) may clear once that process goes, or a reload frees the id.
FINAL_HELLO_REFUSALS = frozenset({"forbidden", "unsupported_version", "bad_request"})


@dataclass(frozen=True, slots=True)
class ControlAddress:
    """Where the router's control socket listens: a Unix path or a loopback TCP port."""

    scheme: Literal["unix", "tcp"]
    path: str = ""
    host: str = ""
    port: int = 0


def parse_control_address(address: str) -> ControlAddress:
    """Parse `unix:/path` or `tcp://host:port`; raises ValueError naming the bad value."""
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        if not path:
            raise ValueError(f"control address {address!r} names no socket path")
        return ControlAddress("unix", path=path)
    if address.startswith("tcp://"):
        host, sep, port_text = address.removeprefix("tcp://").rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            valid_host = ":" in host and _is_ip(host)  # a bracketed IPv6 address
        else:
            valid_host = _is_ip(host) or _HOSTNAME.fullmatch(host) is not None
        # ASCII digits only: str.isdigit() also takes other scripts' digits, which int()
        # reads as a port nobody wrote.
        port_ok = port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536
        if not sep or not valid_host or not port_ok:
            raise ValueError(f"control address {address!r} must be tcp://host:port")
        return ControlAddress("tcp", host=host, port=int(port_text))
    raise ValueError(f"control address {address!r} must be unix:/path or tcp://host:port")


# A DNS name (letters, digits and hyphens in dot-separated labels): one the resolver
# would refuse (`a..b` fails idna's check) is a bad address now, not a connect that
# fails for ever.
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _is_ip(host: str) -> bool:
    # As router.config.addresses's: the client imports none of the router's modules.
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def encode_line(message: Mapping[str, object]) -> bytes:
    """One NDJSON line: compact UTF-8 JSON and a trailing newline."""
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
    return text.encode() + b"\n"


def decode_reply(line: bytes) -> Reply | None:
    """The JSON object on `line`, or None when it is not one."""
    try:
        value = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return None
    return value if isinstance(value, dict) else None


def hello_message(worker_id: str, url: str, boot: str, secret: str | None) -> Reply:
    """The `hello` message (without an id); `secret` goes in `auth` (tcp:// only)."""
    message: Reply = {
        "op": "hello",
        "v": PROTOCOL_VERSION,
        "worker": worker_id,
        "url": url,
        "boot": boot,
    }
    if secret:
        message["auth"] = secret
    return message


def sync_refusals(reply: Mapping[str, object]) -> tuple[list[tuple[str, str, object]], int]:
    """The (kind, key, error) of each claim a sync reply lists as refused, and how many
    more it refused without listing them (`refused_omitted`, 0 when absent)."""
    listed = reply.get("refused")
    refused = [
        (str(item.get("kind", "episode")), str(item.get("key")), item.get("error"))
        for item in (listed if isinstance(listed, list) else ())
        if isinstance(item, dict)
    ]
    omitted = reply.get("refused_omitted")
    if not isinstance(omitted, int) or isinstance(omitted, bool) or omitted < 0:
        omitted = 0
    return refused, omitted


def sync_messages(
    claims: Iterable[tuple[str, str]], *, batch: int = SYNC_BATCH_CLAIMS
) -> list[Reply]:
    """The `sync` messages (without ids) that declare `claims`, (kind, key) pairs, in full.

    Each message carries at most `batch` claims and stays well under the line
    limit; all but the last say `more: true`. An empty set is one empty sync.
    """
    budget = MAX_LINE_BYTES // 2  # leaves room for the envelope and JSON escapes
    batches: list[list[dict[str, str]]] = [[]]
    size = 0
    for kind, key in sorted(set(claims)):
        # As written on the line: JSON escapes a control character in six bytes.
        cost = len(encode_line({"kind": kind, "key": key}))  # its comma for the newline
        if len(batches[-1]) >= batch or (batches[-1] and size + cost > budget):
            batches.append([])
            size = 0
        batches[-1].append({"kind": kind, "key": key})
        size += cost
    last = len(batches) - 1
    return [{"op": "sync", "claims": part, "more": i < last} for i, part in enumerate(batches)]
