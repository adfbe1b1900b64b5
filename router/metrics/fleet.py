"""The fleet's metrics (design §10): the directory and the peer hop, read at scrape time.

`FleetFigures` is what the router's fleet link counted (lookups by what they meant,
directory calls that failed, hops to peers by outcome, hops refused on the peer
listener, registrations lost or fenced, whether it is registered now, the live members
at the last membership read, the lookups' time); `FleetCollector` shows it. The link
keeps plain numbers; they become families only at scrape time. Every label value comes
from a fixed set, never from Redis or a peer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Final, NamedTuple

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from router.metrics.labels import NAMESPACE, OTHER

__all__ = [
    "DIRECTORY_CALLS",
    "LOOKUP_RESULTS",
    "PEER_FORWARD_OUTCOMES",
    "PEER_REFUSALS",
    "FleetCollector",
    "FleetFigures",
]

# RequestMeaning's values: what a lookup meant for its request.
LOOKUP_RESULTS: Final = ("local", "peer", "worker_exited", "episode_ended", "unknown", "recovering")
DIRECTORY_CALLS: Final = ("register", "claim", "release", "lookup", "write_back", "workers")
# `direct`: straight to the owner's worker, on one host (shape B).
PEER_FORWARD_OUTCOMES: Final = ("forwarded", "direct", "owner_unreachable", "not_owner", "failed")
PEER_REFUSALS: Final = ("signature", "not_owner")


class FleetFigures(NamedTuple):
    """What the fleet link counted, as of the scrape."""

    lookups: Mapping[str, int]
    directory_errors: Mapping[str, int]
    peer_forwards: Mapping[str, int]
    peer_refused: Mapping[str, int]
    registered: bool
    fenced: int
    lost: int
    members: int
    lookup_seconds_count: int
    lookup_seconds_sum: float
    prefix_routes: int = 0


class FleetCollector(Collector):
    """Reads the fleet link's counts when Prometheus scrapes, never before."""

    def __init__(self, figures: Callable[[], FleetFigures]) -> None:
        self._figures = figures

    def describe(self) -> Iterator[Metric]:
        return _families(FleetFigures({}, {}, {}, {}, False, 0, 0, 0, 0, 0.0))

    def collect(self) -> Iterator[Metric]:
        return _families(self._figures())


def _labelled(
    name: str, documentation: str, label: str, values: tuple[str, ...], counts: Mapping[str, int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{NAMESPACE}_{name}", documentation, labels=(label,))
    for value in values:
        family.add_metric((value,), counts.get(value, 0))
    other = sum(count for value, count in counts.items() if value not in values)
    if other:
        family.add_metric((OTHER,), other)
    return family


def _families(figures: FleetFigures) -> Iterator[Metric]:
    yield _labelled(
        "directory_lookups",
        "Keys this router's table did not know, looked up in the directory, by what the "
        "lookup meant for the request (recovering: no answer in time, or repopulating).",
        "result",
        LOOKUP_RESULTS,
        figures.lookups,
    )
    yield _labelled(
        "directory_errors",
        "Directory calls that failed (late, unreachable, circuit breaker open), by call.",
        "call",
        DIRECTORY_CALLS,
        figures.directory_errors,
    )
    yield _labelled(
        "peer_forwards",
        "Requests forwarded to the router that holds their key (or straight to its worker, "
        "on one host: direct), by outcome.",
        "outcome",
        PEER_FORWARD_OUTCOMES,
        figures.peer_forwards,
    )
    yield _labelled(
        "peer_refused",
        "Requests the peer listener refused: no valid hop signature (403), or a hop meant "
        "for another incarnation of this router (421).",
        "reason",
        PEER_REFUSALS,
        figures.peer_refused,
    )
    yield GaugeMetricFamily(
        f"{NAMESPACE}_directory_registered",
        "1 while this router holds a live registration in the directory.",
        value=1 if figures.registered else 0,
    )
    yield CounterMetricFamily(
        f"{NAMESPACE}_directory_fenced",
        "Times the directory fenced this router (paused or cut off past its lease): its "
        "claims turned 410 and it registered again.",
        value=figures.fenced,
    )
    yield CounterMetricFamily(
        f"{NAMESPACE}_directory_lost",
        "Times the directory had lost this router's registration (its data lost): it "
        "registered again and wrote its table back.",
        value=figures.lost,
    )
    yield GaugeMetricFamily(
        f"{NAMESPACE}_fleet_members",
        "Routers with a live lease at the last membership read (this one included).",
        value=figures.members,
    )
    yield CounterMetricFamily(
        f"{NAMESPACE}_directory_prefix_routes",
        "Keys this router's table did not know, sent to the router their prefix names "
        "(directory.key_prefix), with no lookup.",
        value=figures.prefix_routes,
    )
    yield SummaryMetricFamily(
        f"{NAMESPACE}_directory_lookup_seconds",
        "Time a request waited for its directory lookup.",
        count_value=figures.lookup_seconds_count,
        sum_value=figures.lookup_seconds_sum,
    )
