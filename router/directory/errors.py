"""The directory's errors: what a call to Redis can fail with, as the router will see it.

Three classes, each a reason the router answers 503 `recovering` on the request path
and `directory_unavailable` on the control socket (design §10): the directory did not
answer within the call's deadline, could not be reached (or the circuit breaker is
open), or answered something the scripts never send. Pure: no I/O.
"""

from __future__ import annotations


class DirectoryError(Exception):
    """A directory call did not give an answer the router can act on."""


class DirectoryTimeout(DirectoryError):
    """The call's deadline passed before the directory answered."""


class DirectoryUnavailable(DirectoryError):
    """The directory could not be reached, or the circuit breaker is open."""


class DirectoryReplyError(DirectoryError):
    """The directory answered with something the scripts never return."""


class DirectoryFenced(DirectoryError):
    """The directory refused a write: this incarnation is fenced (a newer epoch, a
    death certificate, a lapsed lease) or unknown to it (it lost its data). The router
    retires and registers again; nothing of the refused call was written."""

    def __init__(self, standing: str) -> None:
        super().__init__(f"the directory refused the write: {standing}")
        self.standing = standing
