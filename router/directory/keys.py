"""The directory's key layout in Redis (design §10): where each record of a fleet lives.

Every key of one fleet starts with the fleet's prefix inside a hash tag, `{prefix}:`,
so several fleets share one Redis (each its own prefix) and all of one fleet's keys
fall in one hash slot. The scripts compute membership and certificate keys from the
prefix themselves, which Redis Cluster accepts only for keys of one slot: the layout
is ready for Cluster that way, but the directory supports standalone Redis and
Sentinel only, and is tested on those.

Pure: strings in, strings out; no I/O.
"""

from __future__ import annotations

import re

# Router ids and kind names become parts of keys separated by ':', so neither may hold one.
# Router ids are Kubernetes pod names (DNS labels) by default, which this admits.
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
# A prefix names a fleet; braces would end the hash tag early.
_PREFIX = re.compile(r"[A-Za-z0-9._:-]{1,64}")

DEFAULT_PREFIX = "episode-router"  # one fleet per Redis needs no configuration


def check_name(what: str, value: str) -> str:
    """Return `value` if it may be a router id or a kind name; raise ValueError if not."""
    if not _NAME.fullmatch(value):
        raise ValueError(f"{what} must be 1-128 characters of [A-Za-z0-9._-], not {value!r}")
    return value


class KeyLayout:
    """The Redis keys of one fleet.

    - `{p}:fleet`: a hash, the fleet's own record (`since`, `beat`, `grace`, in the
      directory's milliseconds);
    - `{p}:members`: a hash, router id -> `"<epoch> <lease deadline ms> <peer address>"`;
    - `{p}:epoch:<router>`: the router's incarnation counter (INCR; never expires);
    - `{p}:dead:<router>:<epoch>`: a death certificate, kept the tombstone TTL;
    - `{p}:held:<router>:<epoch>`: a set, the owner keys an incarnation holds;
    - `{p}:reap`: a set of dead incarnations whose records still wait for their TTL;
    - `{p}:owner:<kind>:<key>`: a hash, an owner record (`r` router, `e` epoch,
      `s` state: `h` held, `e` ended; `w` the worker process holding it, if published);
    - `{p}:workers:<router>:<epoch>`: a hash, an incarnation's published workers
      (reference -> `"<url> <boot>"`, and `~host`: the host they are reachable from).
    """

    __slots__ = ("_owner", "_workers", "prefix")

    def __init__(self, fleet: str = DEFAULT_PREFIX) -> None:
        if not _PREFIX.fullmatch(fleet):
            raise ValueError(
                f"a directory prefix is 1-64 characters of [A-Za-z0-9._:-], not {fleet!r}"
            )
        self.prefix = "{" + fleet + "}"
        self._owner = self.prefix + ":owner:"
        self._workers = self.prefix + ":workers:"

    @property
    def owner_prefix(self) -> str:
        """What every owner record's key starts with."""
        return self._owner

    @property
    def workers_prefix(self) -> str:
        """What every incarnation's worker table's key starts with."""
        return self._workers

    def workers(self, router_id: str, epoch: int) -> str:
        return f"{self._workers}{router_id}:{epoch}"

    def owner(self, kind: str, key: str) -> str:
        """The owner record's key for a session key of a kind (the kind is checked by the
        caller once, at configuration: this is on the lookup path)."""
        return self._owner + kind + ":" + key

    def members(self) -> str:
        return self.prefix + ":members"

    def fleet(self) -> str:
        return self.prefix + ":fleet"

    def epoch(self, router_id: str) -> str:
        return f"{self.prefix}:epoch:{router_id}"

    def death(self, router_id: str, epoch: int) -> str:
        return f"{self.prefix}:dead:{router_id}:{epoch}"

    def held(self, router_id: str, epoch: int) -> str:
        return f"{self.prefix}:held:{router_id}:{epoch}"
