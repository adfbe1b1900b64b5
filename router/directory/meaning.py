"""What a directory lookup means for a request (design §10, the request path, step 2).

The router asks this only for a key its own table does not know (step 1 sends no
directory traffic). Pure: the lookup's result and the fleet as the same script call
saw it go in, one `RequestMeaning` comes out.
"""

from __future__ import annotations

import enum

from router.directory.records import FleetView, LookupResult, LookupState


class RequestMeaning(enum.Enum):
    """What the router does with a request whose key it looked up."""

    LOCAL = "local"  # held by this very incarnation: the local table is the authority
    PEER = "peer"  # held by a live peer: forward it there, one hop at most
    WORKER_EXITED = "worker_exited"  # 410: its owner's incarnation is dead
    EPISODE_ENDED = "episode_ended"  # 410: released
    UNKNOWN = "unknown"  # 401 unknown_episode (404 unknown_session for MCP kinds)
    RECOVERING = "recovering"  # 503 with Retry-After: never a wrong 401


# A directory that did not answer (late, unreachable, breaker open): never a wrong 401.
WITHOUT_AN_ANSWER = RequestMeaning.RECOVERING


def meaning_of(
    result: LookupResult, fleet: FleetView, router_id: str, epoch: int, lease_ms: int
) -> RequestMeaning:
    """The meaning of `result` for the router `router_id` at incarnation `epoch`.

    An absent record is 401 only once the fleet record is older than one lease: a
    directory that lost its data (or a fleet just started) is being repopulated from
    the routers' own tables, and an absent key may be one not written back yet."""
    state = result.state
    if state is LookupState.HELD:
        owner = result.owner
        if owner is not None and owner.router_id == router_id:
            # Our own key that our table does not know: only an earlier incarnation of
            # ours can hold it, and the script already calls that dead; say so anyway.
            return RequestMeaning.LOCAL if owner.epoch == epoch else RequestMeaning.WORKER_EXITED
        return RequestMeaning.PEER
    if state is LookupState.ENDED:
        return RequestMeaning.EPISODE_ENDED
    if state is LookupState.DEAD:
        return RequestMeaning.WORKER_EXITED
    if fleet.repopulating(lease_ms):
        return RequestMeaning.RECOVERING
    return RequestMeaning.UNKNOWN
