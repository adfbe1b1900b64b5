"""The label values the router's metrics may take (design §6), and the metric namespace.

This module owns the fixed sets every label value comes from (session kinds aside,
which the configuration names, and worker ids, which `router.metrics.registry` bounds): the
outcomes, status classes, control ops and results, upstream failure kinds and worker
states, with "other" for anything outside them; and the mapping of a status to its
class, which the request path calls for every forwarded request.

It must never hold a value a client or worker chose, and it keeps no counts: the
metrics live in `router.metrics.registry` and its collectors.
"""

from __future__ import annotations

from typing import Final

from router.core import WorkerState

__all__ = [
    "CLASS_LABELS",
    "CLIENT_CLOSED",
    "CONTROL_OPS",
    "CONTROL_RESULTS",
    "FORWARDED",
    "INVALID_OP",
    "NAMESPACE",
    "OTHER",
    "SESSIONLESS",
    "STATUS_CLASSES",
    "UPSTREAM_FAILURE_KINDS",
    "WORKER_STATES",
    "class_index",
    "status_class",
]

NAMESPACE: Final = "episode_router"  # every metric's name starts with it and "_"

SESSIONLESS: Final = "none"  # the `kind` label of a request that names no session
OTHER: Final = "other"  # any label value outside its fixed set
FORWARDED: Final = "forwarded"
CLIENT_CLOSED: Final = "client_closed"  # the client left before its reply head (499)
STATUS_CLASSES: Final = ("1xx", "2xx", "3xx", "4xx", "5xx")
# The control protocol's ops (design §3); any other op string is counted as "invalid".
CONTROL_OPS: Final = ("hello", "claim", "release", "sync", "drain", "bye", "ping")
INVALID_OP: Final = "invalid"
# "ok" and every error code a control reply can carry (design §3). This tuple is not
# Final: mypyc (setup.py) leaves a Final tuple built with * unset.
CONTROL_RESULTS: tuple[str, ...] = (
    *("ok", "bad_request", "unknown_op", "no_hello", "unsupported_version", "forbidden"),
    *("worker_busy", "conflict", "ended", "worker_exited", "unknown_kind", "not_holder"),
    *("too_many_claims", "too_many_connections"),
)
UPSTREAM_FAILURE_KINDS: Final = ("refused", "error", "timeout")
WORKER_STATES: Final = tuple(state.value for state in WorkerState)


def status_class(status: int) -> str:
    """The class of `status`: "2xx" for 200..299 and so on; "other" outside 100..599."""
    return CLASS_LABELS[class_index(status)]


CLASS_LABELS: Final = (*STATUS_CLASSES, OTHER)


def class_index(status: int) -> int:
    """Where `status_class(status)` is in CLASS_LABELS."""
    return status // 100 - 1 if 100 <= status <= 599 else len(STATUS_CLASSES)
