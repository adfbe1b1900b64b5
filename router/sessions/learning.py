"""Learning claims from replies, for workers that never speak on the control socket.

A seed route's 2xx reply teaches the router the session it created: from
Set-Cookie, a reply header, or a JSON pointer into a small body (the first of a
kind's places that the reply carries), or, for a kind whose seed names its own
session, the key the request named. A close route's 2xx reply ends one (a key the
router never knew is remembered as ended); every reply on the MCP path that
carries `Mcp-Session-Id` teaches that session, and a 2xx answer to DELETE there
ends it (design §4, §7). A seed reply that names no session a kind learns from is
counted and logged: a config that cannot work is loud.

`plan_learning` decides, from the request alone, whether a reply needs
watching at all, so requests that cannot teach anything (every episode-token
call) pay nothing. `ReplyLearner` is the observer the forwarder shows the reply
to; it changes the claim table through the core, before the client sees the
reply. Pure: no I/O, `now` comes from the caller.

With a claims directory (a `BatchClaimGate`, design §10) a key the local table does not
know is learned only once the directory holds it: `head` and `body` then set
`directory_write`, which the forwarder awaits before it relays the reply (False: the
client gets 503 instead of it), and a close's 2xx tells the gate of what it ended.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from router.core import ClaimState, RouterCore, Worker
from router.directory.errors import DirectoryError
from router.directory.gate import BatchClaimGate
from router.directory.records import ClaimVerdict
from router.sessions.formats import FormatError, mcp_session_key
from router.sessions.reader import Headers, SessionKind, SessionReader, SessionRef, session_key
from router.sessions.sources import json_pointer, set_cookie_value
from router.tokens import RefusedValue

log = logging.getLogger("episode_router.learn")

MAX_LEARN_BODY_BYTES = 65536  # a seed reply larger than this is relayed without learning


class LearningCounts(Protocol):
    """Where learning is counted (the router's metrics)."""

    def learned(self, kind: str) -> None: ...
    def learn_conflict(self, kind: str) -> None: ...
    def learn_missed(self, kind: str) -> None: ...


@dataclass(frozen=True, slots=True)
class LearningPlan:
    """What one request's reply may teach."""

    seed: tuple[SessionKind, ...] = ()  # kinds whose seed route this request is
    close: SessionRef | None = None  # the session a close route ends
    mcp: SessionKind | None = None  # the MCP kind, when the request is on its path
    mcp_release: str | None = None  # the Mcp-Session-Id a DELETE ends
    named: tuple[SessionRef, ...] = ()  # sessions the seed request names itself

    def __bool__(self) -> bool:
        return bool(self.seed or self.close or self.mcp or self.named)


def plan_learning(
    reader: SessionReader,
    method: str,
    path: str,
    found: SessionRef | None,
    seeding: frozenset[str],
    headers: Headers,
    now: float,
    body: bytes | None = None,
) -> LearningPlan:
    """What to watch in the reply to `method path` (the route path), which named
    session `found`; `now` (wall-clock seconds) and the request's `body` (when it was
    read) read a kind's own source where a stronger one decided (read_kind)."""
    seed = tuple(reader.by_name[name] for name in sorted(seeding))
    close = None
    if found is not None:
        kind = reader.by_name[found.kind]
        if kind.close is not None and kind.close.matches(method, path):
            close = found
    if close is None:
        # A close route of a kind that did not decide the request: a stronger source
        # routed it (the episode token travels beside the cookie). The session it ends
        # is named by the kind's own source, as an MCP DELETE's is by its header.
        for kind in reader.kinds:
            if kind.close is not None and kind.close.matches(method, path):
                own = reader.read_kind(kind, headers, now, body=body, path=path)
                if isinstance(own, SessionRef):
                    close = own
                    break
    named: list[SessionRef] = []
    for kind in reader.kinds:
        if kind.names_own_seed and kind.seed is not None and kind.seed.matches(method, path):
            if found is not None and found.kind == kind.name:
                named.append(found)
            else:
                own = reader.read_kind(kind, headers, now, body=body, path=path)
                if isinstance(own, SessionRef):
                    named.append(own)
    mcp = next((k for k in reader.kinds if k.mcp_path is not None and k.mcp_path == path), None)
    mcp_release = None
    if mcp is not None and method == "DELETE":
        # The MCP session this DELETE ends is its own Mcp-Session-Id, even when the
        # request was routed by a stronger source (the episode token travels on it).
        values = headers.getall(mcp.header or "", [])
        # The same id repeated is one id, as the head's reading took it (routed by it).
        if values and all(value == values[0] for value in values):
            try:
                mcp_release = mcp_session_key(values[0])
            except FormatError:
                mcp_release = None
    return LearningPlan(seed, close, mcp, mcp_release, tuple(named))


class ReplyLearner:
    """Watches one reply and teaches the core what it says (a ReplyObserver)."""

    __slots__ = (
        "_clock",
        "_core",
        "_gate",
        "_metrics",
        "_pending",
        "_plan",
        "_taught",
        "_unwritten",
        "_wall_clock",
        "_worker",
        "directory_write",
    )

    def __init__(
        self,
        plan: LearningPlan,
        core: RouterCore,
        worker: Worker,
        *,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        metrics: LearningCounts | None = None,
        gate: BatchClaimGate | None = None,
    ) -> None:
        self._plan = plan
        self._gate = gate
        # With a gate: the keys this reply taught that the directory must take before
        # the reply goes on, and the write the forwarder awaits (None: nothing to write).
        self._unwritten: list[tuple[str, str]] = []
        self.directory_write: Coroutine[Any, Any, bool] | None = None
        self._metrics = metrics
        self._core = core
        self._worker = worker
        self._clock = clock
        self._wall_clock = wall_clock
        self._pending: list[SessionKind] = []
        self._taught: list[tuple[str, str]] = []  # what this reply taught, to link them

    def head(self, status: int, headers: Mapping[str, str], set_cookies: list[str]) -> int:
        plan = self._plan
        ok = 200 <= status < 300
        if plan.mcp is not None:
            self._learn_mcp(plan.mcp, headers, ok)
        if not ok:
            return 0
        if plan.close is not None:
            self._release(plan.close.kind, plan.close.key)
        for named in plan.named:
            self._learn_key(named.kind, named.key)
        for kind in plan.seed:
            value = self._from_head(kind, headers, set_cookies)
            if value is None and any(place.json_pointer is not None for place in kind.learn):
                self._pending.append(kind)  # its places in the body, once that is in
            else:
                self._learn(kind, value)
        return MAX_LEARN_BODY_BYTES if self._pending else 0

    def _from_head(
        self, kind: SessionKind, headers: Mapping[str, str], set_cookies: list[str]
    ) -> str | None:
        """The first of `kind`'s places in the reply's head (a cookie, a header) that
        holds a value; the body's places are read after the head's."""
        for place in kind.learn:
            value = None
            if place.cookie is not None:
                value = set_cookie_value(set_cookies, place.cookie, now=self._wall_clock())
            elif place.header is not None:
                value = headers.get(place.header)
            if value:
                return value
        return None

    def body(self, data: bytes) -> None:
        try:
            document = json.loads(data)
        except (ValueError, RecursionError):
            log.warning(
                "seed reply is not JSON: nothing learned",
                extra={"worker": self._worker.id, "kinds": [k.name for k in self._pending]},
            )
            for kind in self._pending:
                self._missed(kind)
            return
        for kind in self._pending:
            self._learn(kind, _first_pointer(kind, document))

    def _learn_mcp(self, kind: SessionKind, headers: Mapping[str, str], ok: bool) -> None:
        plan = self._plan
        if plan.mcp_release is not None and ok:
            self._release(kind.name, plan.mcp_release)
            return
        if ok and kind.header is not None and kind.header in headers:
            self._learn(kind, headers[kind.header])

    def _learn(self, kind: SessionKind, value: str | None) -> None:
        if not value:
            self._missed(kind)
            return
        try:
            key = session_key(kind, value, self._wall_clock())
        except RefusedValue as exc:  # a TokenError or a FormatError
            log.warning(
                "seed reply's session is unreadable",
                extra={"kind": kind.name, "worker": self._worker.id, "error": exc.code},
            )
            return
        self._learn_key(kind.name, key)

    def _missed(self, kind: SessionKind) -> None:
        """A seed reply named no session where `kind` looks: with the config as it is,
        this kind never routes (design §4)."""
        route = f"{kind.seed.method} {kind.seed.path}" if kind.seed is not None else None
        log.warning(
            "seed reply named no session",
            extra={"kind": kind.name, "route": route, "worker": self._worker.id},
        )
        self._core.learn_missed(kind.name)
        if self._metrics is not None:
            self._metrics.learn_missed(kind.name)

    def _release(self, kind_name: str, key: str) -> None:
        """A close's 2xx: the session ends, under every kind its seed reply taught it;
        with a gate, the directory marks each record ended."""
        gate = self._gate
        if gate is None:
            self._core.release_learned(self._worker, kind_name, key, self._clock())
            return
        claim = self._core.claims.lookup(kind_name, key)
        siblings = claim.siblings if claim is not None else ()
        ending = [(kind_name, key)] + [
            (s.kind, s.key)
            for s in siblings
            if s.state is ClaimState.HELD and s.worker == self._worker.id
        ]
        if self._core.release_learned(self._worker, kind_name, key, self._clock()):
            for pair in ending:
                gate.released(*pair)

    def _learn_key(self, kind_name: str, key: str) -> None:
        if self._gate is not None and self._core.claims.lookup(kind_name, key) is None:
            # Not known here: learned once the directory holds it (design §10).
            self._unwritten.append((kind_name, key))
            if self.directory_write is None:
                self.directory_write = self._write_through_gate(self._gate)
            return
        self._learn_locally(kind_name, key)

    async def _write_through_gate(self, gate: BatchClaimGate) -> bool:
        """Claims the keys this reply taught in the directory, and learns those it took;
        False when it did not answer in time for one of them (the reply must not reach
        the client: its session would route nowhere). Keys taught by the body after the
        head are in the list by the time the forwarder awaits this. All of them go in
        one call (batched with the other claims of this loop turn), not a round trip a
        key; a key the directory took is learned even when another's call failed, so
        the local table holds what the directory says this router holds."""
        keys = list(self._unwritten)
        answers = await gate.claim_each(keys, self._worker)
        written = True
        for (kind_name, key), answer in zip(keys, answers, strict=True):
            if isinstance(answer, DirectoryError):
                log.warning(
                    "learned claim not written: the claims directory did not answer",
                    extra={"kind": kind_name, "worker": self._worker.id, "error": str(answer)},
                )
                written = False
            elif answer.verdict is ClaimVerdict.CLAIMED:
                self._learn_locally(kind_name, key)
            else:
                self._core.learn_conflicts += 1  # as core.learn counts a local refusal
                self._refused(kind_name, answer.verdict.value, answer.holder)
        return written

    def _learn_locally(self, kind_name: str, key: str) -> None:
        refusal = self._core.learn(self._worker, kind_name, key, self._clock())
        if refusal is not None:
            # design §4: a learned key another worker holds is not learned: counted, logged.
            # The key this very worker holds (a repeated seed) is no refusal.
            self._refused(kind_name, refusal.error, refusal.holder)
            return
        if self._metrics is not None:
            self._metrics.learned(kind_name)
        self._taught.append((kind_name, key))
        if len(self._taught) > 1:
            self._core.link_learned(self._taught)

    def _refused(self, kind_name: str, error: str, holder: str | None) -> None:
        """A learned key another worker (or, with a directory, another router) holds, or
        that ended or exited, is not learned: counted as a conflict, logged."""
        log.warning(
            "learned claim refused",
            extra={"kind": kind_name, "worker": self._worker.id, "error": error, "holder": holder},
        )
        if self._metrics is not None:
            self._metrics.learn_conflict(kind_name)


def _first_pointer(kind: SessionKind, document: object) -> str | None:
    """The value at the first of `kind`'s JSON pointers that the reply's body has, as
    a string (a number is a key too); None when none has one."""
    for place in kind.learn:
        if place.json_pointer is None:
            continue
        try:
            value = json_pointer(document, place.json_pointer)
        except LookupError:
            continue
        if isinstance(value, str | int) and not isinstance(value, bool) and value != "":
            return str(value)
    return None
