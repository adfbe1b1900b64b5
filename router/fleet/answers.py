"""The answers of design §10's request path that a lookup, or a peer hop, decides: pure.

`answer_for` gives what a key the local table does not know gets when the directory
decided it (None where the local table's own answer stands: the key is this
incarnation's, or nobody's in a settled fleet); the rest name the peer hop's refusals.
"""

from __future__ import annotations

from typing import Final

from router.core import Answer
from router.directory.meaning import RequestMeaning

# A directory that does not answer is short: the next try may well find it.
RECOVERING_RETRY_S: Final = 1.0


def answer_for(meaning: RequestMeaning, key: str, mcp: bool) -> Answer | None:
    """The answer for `key` (of an MCP kind when `mcp`), or None for the local table's."""
    if meaning is RequestMeaning.WORKER_EXITED:
        return Answer(
            "worker_exited", "The router that ran this episode is no longer running.", key
        )
    if meaning is RequestMeaning.EPISODE_ENDED:
        if mcp:
            return Answer("unknown_session", "No MCP session with this id; start a new one.", key)
        return Answer("episode_ended", "This episode has ended.", key)
    if meaning is RequestMeaning.RECOVERING:
        return Answer(
            "recovering",
            "The claims directory did not answer for this episode; retry shortly.",
            key,
            retry_after_s=RECOVERING_RETRY_S,
        )
    return None


def owner_unreachable(key: str) -> Answer:
    """503 while the owner's lease runs and its peer listener does not answer; 410 once
    the lease lapses (the lookup then finds it dead)."""
    return Answer(
        "owner_unreachable",
        "The router that holds this episode cannot be reached now; retry shortly.",
        key,
        retry_after_s=RECOVERING_RETRY_S,
    )


def not_owner(key: str | None) -> Answer:
    """421: the hop was meant for another incarnation of this router (it restarted)."""
    return Answer("not_owner", "This router is not the incarnation the hop was meant for.", key)


def owner_restarted(key: str) -> Answer:
    """503: the owner answered 421 `not_owner` to the hop (it registered again since the
    lookup); never relayed: the retry's lookup finds the key's new owner, or its end."""
    return Answer(
        "recovering",
        "The router that holds this episode restarted as it was reached; retry.",
        key,
        retry_after_s=RECOVERING_RETRY_S,
    )


def peer_refused(reason: str, key: str | None) -> Answer:
    """403: a request on the peer listener without a valid hop signature."""
    return Answer("peer_refused", f"The peer listener refused the hop: {reason}.", key)


def lease_lapsed(key: str) -> Answer:
    """503: this router's lease in the directory may have lapsed (its heartbeat has not
    been answered for a lease): the fleet may have declared it dead and answered 410, so
    it serves none of its keys until the directory renews it or fences it."""
    return Answer(
        "recovering",
        "This router cannot reach the claims directory to renew its lease; retry shortly.",
        key,
        retry_after_s=RECOVERING_RETRY_S,
    )
