"""Where a forward goes: the worker's upstream, the headers the router adds, the origin.

This module owns what the public handler hands the relay about a forward's destination
and the caches that keep it cheap: the upstream and added headers (the boot) kept per
worker while its address and boot stay, and the public origin kept while the Host
stays. It does no I/O and never waits: it never routes, never forwards and never
answers.
"""

from __future__ import annotations

from typing import Final

from router.core import Forward, Worker
from router.directory import OwnerWorker
from router.protocol import BOOT_HEADER
from router.relay import NO_EXTRA, Upstream

__all__ = [
    "MAX_KEPT_DESTINATIONS",
    "Destination",
    "destination",
    "owner_worker_destination",
    "public_base",
]


class Destination:
    """Where the forwards to one worker go and the headers the router adds (its boot),
    kept while the worker's address and boot stay. Built per request, `destination`
    cost more, its Upstream's release included."""

    __slots__ = ("boot", "extra", "upstream", "url")

    def __init__(self, worker: Worker, boot: str | None) -> None:
        self.url = worker.url
        self.boot = boot
        self.upstream = Upstream(worker.id, worker.url)
        self.extra: dict[str, str] = {BOOT_HEADER: boot} if boot else NO_EXTRA


# The destinations kept, by worker id: emptied when this many, so workers that come and
# go cannot grow it.
MAX_KEPT_DESTINATIONS: Final = 1024
_DESTINATIONS: Final[dict[str, Destination]] = {}


def destination(decision: Forward, host: str) -> tuple[Upstream, dict[str, str], str]:
    """Where a forward goes, the headers the router adds (the boot), and the public
    origin (from the request's `host`) a Location naming the worker is rewritten to."""
    worker = decision.worker
    kept = _DESTINATIONS.get(worker.id)
    if kept is None or kept.url != worker.url or kept.boot != decision.boot:
        if len(_DESTINATIONS) >= MAX_KEPT_DESTINATIONS:
            _DESTINATIONS.clear()
        kept = _DESTINATIONS[worker.id] = Destination(worker, decision.boot)
    return kept.upstream, kept.extra, public_base(host)


# Another router's workers forwarded to straight (shape B), by address: (the upstream,
# the boot header, that boot). Emptied when this many, as the destinations above. Keyed
# by the address string, not the OwnerWorker: a frozen dataclass's hash and equality
# run interpreted, a request's cost in the compiled build.
_OWNER_WORKERS: Final[dict[str, tuple[Upstream, dict[str, str], str]]] = {}


def owner_worker_destination(worker: OwnerWorker) -> tuple[Upstream, dict[str, str]]:
    """Where a forward straight to another router's worker goes (one pool per address),
    and its boot header (a new process at the address has another boot)."""
    kept = _OWNER_WORKERS.get(worker.url)
    if kept is None or kept[2] != worker.boot:
        if len(_OWNER_WORKERS) >= MAX_KEPT_DESTINATIONS:
            _OWNER_WORKERS.clear()
        kept = _OWNER_WORKERS[worker.url] = (
            Upstream(f"owner-worker:{worker.url}", worker.url),
            {BOOT_HEADER: worker.boot},
            worker.boot,
        )
    return kept[0], kept[1]


class _LastBase:
    """The last public origin built, and the Host it was built from."""

    def __init__(self) -> None:
        self.host = ""
        self.base = "http://"


# The same Host request after request (see router.edge.head_text's host_text): the last origin
# is reused, instead of formatted again.
_LAST_BASE: Final = _LastBase()


def public_base(host: str) -> str:
    """The public origin a request with this Host reached the router at."""
    last = _LAST_BASE
    if host == last.host:
        return last.base
    base = f"http://{host}"
    last.host = host
    last.base = base
    return base
