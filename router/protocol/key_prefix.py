"""The key prefix a hello reply may offer (design §10, "Keys that name their router").

With `directory.key_prefix: true`, a router registered in a claims directory answers a
worker's hello with `key_prefix`, `"<router id>:<epoch>:"`: its incarnation. A worker
that starts the keys it mints with it (the bundled client's `mint_key`) lets any router
of the fleet route them from the membership alone, with no lookup. The separator is
`:`, which an episode id may hold and a router id may not, so the router id and the
epoch are read back without doubt.

Pure: no I/O. Both sides import it: the router composes and reads prefixes, the worker
client only checks that what it was offered can start a key.
"""

from __future__ import annotations

import re

__all__ = ["MAX_KEY_PREFIX_CHARS", "key_prefix", "split_key_prefix", "valid_key_prefix"]

# A router id is 1-128 of [A-Za-z0-9._-] (directory.router_id), an epoch a counter.
_KEY_PREFIX = re.compile(r"([A-Za-z0-9._-]{1,128}):([0-9]{1,18}):")
MAX_KEY_PREFIX_CHARS = 128 + 1 + 18 + 1


def key_prefix(router_id: str, epoch: int) -> str:
    """The prefix that names incarnation `epoch` of router `router_id`."""
    return f"{router_id}:{epoch}:"


def valid_key_prefix(value: object) -> bool:
    """True when `value` is a prefix `key_prefix` could have made."""
    return isinstance(value, str) and _KEY_PREFIX.fullmatch(value) is not None


def split_key_prefix(key: str) -> tuple[str, int] | None:
    """The (router id, epoch) a key's prefix names, or None when it starts with none.
    Whether that incarnation is alive is for the membership to say. A `find` before the
    regex: most keys hold no ':' at all, and this runs for a key no table knows."""
    if key.find(":") < 1:
        return None
    match = _KEY_PREFIX.match(key)
    if match is None:
        return None
    return match.group(1), int(match.group(2))
