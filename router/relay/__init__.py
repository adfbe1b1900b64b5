"""The forwarding path to workers (design §3, §8): keep-alive pools, connections,
request heads and bodies, and the streamed or whole replies.
"""

from __future__ import annotations

from router.relay.contract import (
    BufferLimits,
    ForwardTimeouts,
    Upstream,
    UpstreamFailure,
    as_value,
    end_to_end_headers,
)
from router.relay.forwarder import Forwarder
from router.relay.lane import LaneDone
from router.relay.wire import NO_EXTRA

__all__ = [
    "NO_EXTRA",
    "BufferLimits",
    "ForwardTimeouts",
    "Forwarder",
    "LaneDone",
    "Upstream",
    "UpstreamFailure",
    "as_value",
    "end_to_end_headers",
]
