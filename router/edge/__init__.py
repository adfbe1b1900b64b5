"""The public HTTP/1.1 server (design §8): client connections, their limits and
clocks, the parser, requests and replies. It never decides where a request goes.
"""

from __future__ import annotations

from router.edge.framing import (
    content_length_number,
    framing_problem,
)
from router.edge.request import (
    BodyBroken,
    ClientLost,
    PublicRequest,
)
from router.edge.server import (
    EdgeLimits,
    EdgeServer,
)

__all__ = [
    "BodyBroken",
    "ClientLost",
    "EdgeLimits",
    "EdgeServer",
    "PublicRequest",
    "content_length_number",
    "framing_problem",
]
