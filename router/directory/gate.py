"""What the control socket and the learner need of the directory (design §10, "Writes and
fencing"): a claim acknowledged only once the directory holds its owner record, a release
written after. Pure: Protocols the router's fleet link (router.fleet) implements; a
router without a `directory:` section has none, and claims are the local table's alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.core import Worker
from router.directory.errors import DirectoryError
from router.directory.records import ClaimOutcome


class ClaimGate(Protocol):
    """The directory's half of a claim: written before the worker hears `ok`."""

    async def claim(self, kind: str, key: str, worker: Worker | None = None) -> ClaimOutcome:
        """Write this router's owner record of `key`, which `worker` will hold (batched
        with the other claims of this loop turn). Raises DirectoryError when it was not
        written in time (the worker gets `directory_unavailable`); CONFLICT names the
        live holder."""
        ...

    def released(self, kind: str, key: str) -> None:
        """The local table ended `key`: mark its record ended, in the background (the
        local table stays the authority; a record still held answers from it). The
        releases of one loop turn may go out together."""
        ...


class BatchClaimGate(ClaimGate, Protocol):
    """A `ClaimGate` that also takes many claims in one call: the control socket's,
    where a pipelining worker's read carries hundreds of them."""

    async def claim_each(
        self, keys: Sequence[tuple[str, str]], worker: Worker | None = None
    ) -> Sequence[ClaimOutcome | DirectoryError]:
        """`claim` for each of `keys` (all for `worker`) at once, in order: each key's
        outcome, or the DirectoryError that kept it from being written in time. Never
        raises that."""
        ...

    def key_prefix(self) -> str | None:
        """The key prefix a hello reply offers (design §10), or None for none."""
        ...
