"""The control protocol on the worker side (design §3): the messages a worker sends.

This module owns what a worker needs beyond the shared wire format of
`router.protocol` (the version, the limits, the line codec and the address grammar):
the hello message and which refusals of it
are final, splitting a worker's claims into `sync` messages that stay under the line
limit, and reading the refusals a sync reply lists. `router.client` re-exports the
public names.

It is pure: it must never import asyncio or aiohttp, open a socket, or log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from router.protocol import (
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    ControlAddress,
    Reply,
    encode_line,
    read_control_address,
)

__all__ = [
    "FINAL_HELLO_REFUSALS",
    "SYNC_BATCH_CLAIMS",
    "claims_within_limit",
    "hello_message",
    "parse_control_address",
    "sync_messages",
    "sync_refusals",
]

# The most claims a worker puts in one sync message (the router takes any number a line
# holds; this keeps a message well under the line limit and a reply quick).
SYNC_BATCH_CLAIMS = 1000

# The hello refusals no retry can change: the router's policy refuses this worker's
# secret, uid or url (`forbidden`, until an operator changes the policy), or the
# hello itself (`unsupported_version`, `bad_request`). Any other (`worker_busy`:
# another live process has this worker id or url, or the config names the id as a
# static worker's) may clear once that process goes, or a reload frees the id.
FINAL_HELLO_REFUSALS = frozenset({"forbidden", "unsupported_version", "bad_request"})


def parse_control_address(address: str) -> ControlAddress:
    """The control socket `address` names (`unix:PATH` or `tcp://host:port`, the
    router's own grammar); raises ValueError naming the bad value."""
    parsed = read_control_address(address)
    if isinstance(parsed, str):
        raise ValueError(f"control address {address!r}: {parsed}")
    return parsed


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


def claims_within_limit(
    claims: Iterable[tuple[str, str]], refusal: Mapping[str, object]
) -> set[tuple[str, str]] | None:
    """The claims a worker may declare again after a sync refused `too_many_claims`:
    the first `limit` of `claims` in the order a sync lists them; None when `refusal`
    is not that refusal or names no usable limit."""
    limit = refusal.get("limit")
    if refusal.get("error") != "too_many_claims" or not isinstance(limit, int):
        return None
    if isinstance(limit, bool) or limit < 0:
        return None
    return set(sorted(set(claims))[:limit])
