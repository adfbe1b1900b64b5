"""Many routers, one claim view (design §10): this router's place in the fleet.

`FleetLink` registers the router in the claims directory, keeps its lease, writes its
claims there (the control socket's and the learner's `ClaimGate`) and looks up the keys
its own table does not know; `signature` signs and checks the peer hop (pure).
"""

from __future__ import annotations

from router.fleet.answers import (
    answer_for,
    lease_lapsed,
    not_owner,
    owner_restarted,
    owner_unreachable,
    peer_refused,
)
from router.fleet.link import UNANSWERED, FleetCounts, FleetLink, Lookup
from router.fleet.signature import MAX_CLOCK_SKEW_MS, PEER_HEADER, PeerHop, sign, verify

__all__ = [
    "MAX_CLOCK_SKEW_MS",
    "PEER_HEADER",
    "UNANSWERED",
    "FleetCounts",
    "FleetLink",
    "Lookup",
    "PeerHop",
    "answer_for",
    "lease_lapsed",
    "not_owner",
    "owner_restarted",
    "owner_unreachable",
    "peer_refused",
    "sign",
    "verify",
]
