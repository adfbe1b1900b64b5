"""The control protocol (design §3): one connection's session.

`ControlSession` applies decoded requests to the `RouterCore` on behalf of the
worker that said hello on this connection and returns the reply for each, and
`ControlSession.answer_claim_or_release` answers the commonest lines without
decoding them into a dict. It never reads a socket or a clock: the server in
`router.control.server` and `router.control.connection` do the I/O. The line codec is
`router.protocol.control`, the address grammar `router.protocol.addresses`, the wording
and budget of refusals `router.control.refusals`.

Malformed input is answered, never raised: a bad line gets `bad_request`, an
unknown op `unknown_op`, and the connection goes on.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.control.refusals import (
    SyncRefusals,
    claim_refused,
    not_holder,
    refused_sync_entry,
)
from router.control.waiting import (
    WaitingReply,
    directory_refusal,
    directory_unavailable,
    lease_ended,
)
from router.control.worker_urls import SocketLookup, look_up_socket, url_refusal
from router.core import RouterCore, Worker, WorkerOrigin, WorkerState
from router.directory.gate import BatchClaimGate
from router.directory.records import ClaimVerdict
from router.protocol import (
    MAX_KEY_CHARS,
    PROTOCOL_VERSION,
    Reply,
    UpstreamAddress,
    encode_line,
    error_reply,
    parse_upstream,
    same_upstream,
    valid_boot,
)

_WORKER_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
# A worker runs far fewer episodes at once; at about 700 B a claim this bounds what one
# worker makes the router hold to about 70 MB (control.max_claims_per_worker).
MAX_CLAIMS_PER_WORKER = 100_000
# Twice the largest spawn (256), all reconnecting at once after a router restart; at
# 64 KiB of partial line each, they hold at most 32 MiB (control.max_connections_before_hello).
MAX_CONNECTIONS_BEFORE_HELLO = 512
# Sixteen times the largest spawn: each connection is a descriptor, and each lease a
# worker that may hold max_claims_per_worker claims (control.max_connections).
MAX_CONTROL_CONNECTIONS = 4096


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is on the other end, as the transport tells."""

    uid: int | None  # SO_PEERCRED uid for Unix sockets; None over TCP
    tcp: bool
    pid: int | None = None  # SO_PEERCRED pid: lets the router stop an adopted worker


@dataclass(frozen=True, slots=True)
class ControlPolicy:
    """Who may say hello (design §3 'Who may say hello')."""

    own_uid: int
    allowed_uids: frozenset[int]
    allowed_upstreams: frozenset[str]
    secret: str | None
    router_boot: str
    spawned_ids: frozenset[str] = frozenset()  # the ids of the workers `spawn:` starts
    # The ids of spawned workers that never say hello (`spawn.register: probe`).
    probed_ids: frozenset[str] = frozenset()
    # Claims one worker may hold, and list in one sync (`control.max_claims_per_worker`).
    max_claims_per_worker: int = MAX_CLAIMS_PER_WORKER
    # Connections that may wait for their hello at once (the server refuses more).
    max_connections_before_hello: int = MAX_CONNECTIONS_BEFORE_HELLO
    # Control connections open at once, leased or not (`control.max_connections`).
    max_connections: int = MAX_CONTROL_CONNECTIONS
    # The router's own listeners (public, admin, control): never a worker's url.
    own_listeners: tuple[UpstreamAddress, ...] = ()
    # Folders whose unix sockets any worker may name (`control.worker_socket_dirs`).
    worker_socket_dirs: tuple[str, ...] = ()
    # Where a unix socket path leads and who owns it (the filesystem, but for tests).
    socket_lookup: SocketLookup = look_up_socket

    def worker_url_refusal(
        self, address: UpstreamAddress, owners: frozenset[int] | None
    ) -> str | None:
        """Why a worker whose sockets `owners` may own must not be reached at `address`."""
        return url_refusal(
            address,
            allowed_upstreams=self.allowed_upstreams,
            own_listeners=self.own_listeners,
            socket_dirs=self.worker_socket_dirs,
            owners=owners,
            look_up=self.socket_lookup,
        )


# -- the fast path for claim and release -------------------------------------------
#
# Nearly every line on a busy connection is a claim or a release, written compactly
# in the field order design §3 shows (op, id, key[, kind]) or in the one router.client
# sends (op, key, kind, id). `ControlSession.answer_claim_or_release` takes those with
# one regex match instead of json.loads and the general checks, and writes an ok reply
# from the id's own bytes instead of json.dumps. Any other line, and any line the
# general path would refuse before asking the core, is left to decode_line and handle.
#
# The regexes take only values whose JSON text is their value, so that the bytes can
# stand for the value both ways: strings of printable ASCII without `"` or `\` (no
# escapes; json.dumps writes them back as they are) and integers in canonical form
# (no "-0", no leading zero, at most 18 digits: far below Python's digit limit).
_PLAIN_CHAR = rb"[ !#-\[\]-~]"
_ID = rb'(0|-?[1-9][0-9]{0,17}|"' + _PLAIN_CHAR + rb'*")'
_KEY = rb'"(' + _PLAIN_CHAR + rb"{1,%d})" % MAX_KEY_CHARS + rb'"'
_KIND = rb'"(' + _PLAIN_CHAR + rb'*)"'
_OP = rb'\{"op":"(claim|release)",'
_ID_FIRST = re.compile(
    _OP + rb'"id":' + _ID + rb',"key":' + _KEY + rb'(?:,"kind":' + _KIND + rb")?\}"
)
_ID_LAST = re.compile(_OP + rb'"key":' + _KEY + rb',"kind":' + _KIND + rb',"id":' + _ID + rb"\}")


_CLAIMED = ClaimVerdict.CLAIMED


def _claim_line_fields(line: bytes) -> tuple[bytes, bytes, bytes, bytes | None] | None:
    """The op, raw id, raw key and raw kind (None: the default kind) of a claim or
    release line in one of the two usual shapes; None for any other line.
    (`answer_claim_or_release` inlines this: it is the hot path without a gate.)"""
    match = _ID_FIRST.fullmatch(line)
    if match is not None:
        op, raw_id, raw_key, raw_kind = match.groups()
        return op, raw_id, raw_key, raw_kind
    match = _ID_LAST.fullmatch(line)
    if match is None:
        return None
    op, raw_key, raw_kind, raw_id = match.groups()
    return op, raw_id, raw_key, raw_kind


def _request_id(request_id: object, raw_id: bytes) -> object:
    """A request's id: `raw_id`'s JSON text decoded when given, else `request_id`."""
    return json.loads(raw_id) if raw_id else request_id


def valid_worker_id(worker_id: str) -> bool:
    """True for a worker id a hello may say: 1-64 of [A-Za-z0-9._:-]."""
    return _WORKER_ID.fullmatch(worker_id) is not None


class ControlSession:
    """One control connection: at most one worker's lease."""

    def __init__(
        self,
        core: RouterCore,
        policy: ControlPolicy,
        peer: Peer,
        gate: BatchClaimGate | None = None,
    ) -> None:
        self.core = core
        self.policy = policy
        self.peer = peer
        # The claims directory's half of a claim (design §10); None: the local table's alone.
        self.gate = gate
        # This connection's claims waiting for the gate, by (kind, key): a release or a
        # claim again of one waits behind it, and they count toward the claim cap.
        self._waiting: dict[tuple[str, str], WaitingReply] = {}
        self.worker: Worker | None = None
        self.became_live = False  # the last accepted hello made its worker live
        # The claims of a sync that spans several messages, until its last one. Each
        # message's malformed entries are answered in its own reply, never kept here.
        self._sync_pending: set[tuple[str, str]] | None = None

    def handle(self, request: dict[str, Any], now: float) -> Reply | WaitingReply:
        """Apply one decoded request and return its reply; with a gate, a claim or sync
        the directory must take first returns the `WaitingReply` its reply waits in."""
        request_id = request.get("id")
        op = request["op"]
        handler = self._HANDLERS.get(op)
        if handler is None:
            return error_reply(request_id, "unknown_op", f"Unknown op {op!r}.")
        if op != "hello":
            worker = self.worker
            if worker is None or worker.lease is not self or worker.state is WorkerState.EXITED:
                return error_reply(request_id, "no_hello", "Say hello first.")
            worker.last_heard = now
        return handler(self, request, now)

    def answer_claim_or_release(self, line: bytes, now: float) -> tuple[str, str, bytes] | None:
        """The fast path for a claim or release line (without its newline).

        Returns the op, the result ("ok" or the reply's error code) and the reply
        line, exactly as `encode_line(self.handle(decode_line(line), now))` would give
        them; or None, having changed nothing, when the line is not in one of the
        two usual shapes, or this connection holds no live lease, or the kind is not
        configured: the caller then takes the general path.
        """
        # Far more claim+release pairs a second over one pipelined connection than with
        # every line on the general path (measured: docs/performance.md, "The hot
        # path's trims").
        match = _ID_FIRST.fullmatch(line)
        if match is not None:
            op, raw_id, raw_key, raw_kind = match.groups()
        else:
            match = _ID_LAST.fullmatch(line)
            if match is None:
                return None
            op, raw_key, raw_kind, raw_id = match.groups()
        worker = self.worker
        if worker is None or worker.lease is not self or worker.state is WorkerState.EXITED:
            return None
        kind = "episode" if raw_kind is None else raw_kind.decode()
        if kind not in self.core.settings.kinds:
            return None
        worker.last_heard = now
        if op == b"claim":
            key = raw_key.decode()
            # The cap, inlined (one counter read per claim): _over_claim_cap's rule.
            claims = self.core.claims
            if (
                claims.held_count(worker.id) >= self.policy.max_claims_per_worker
                and claims.lookup(kind, key) is None
            ):
                return "claim", "too_many_claims", encode_line(self._too_many(json.loads(raw_id)))
            refusal = self.core.claim(worker, kind, key, now)
            if refusal is None:
                return "claim", "ok", b'{"id":' + raw_id + b',"ok":true}\n'
            return "claim", refusal.error, encode_line(claim_refused(json.loads(raw_id), refusal))
        if self.core.release(worker, kind, raw_key.decode(), now):
            return "release", "ok", b'{"id":' + raw_id + b',"ok":true}\n'
        return "release", "not_holder", encode_line(not_holder(json.loads(raw_id)))

    def answer_through_gate(
        self, line: bytes, now: float
    ) -> tuple[str, str, bytes | WaitingReply] | None:
        """`answer_claim_or_release` with a gate: the same lines, and the same answers
        but for a claim the directory must take first (a key the local table does not
        know), returned as the `WaitingReply` its reply waits in (its result is then
        ""), and a release of a key whose claim waits, which waits behind it. The id
        stays the line's bytes: decoded only for a refusal."""
        fields = _claim_line_fields(line)
        if fields is None:
            return None
        op, raw_id, raw_key, raw_kind = fields
        worker = self.worker
        if worker is None or worker.lease is not self or worker.state is WorkerState.EXITED:
            return None
        kind = "episode" if raw_kind is None else raw_kind.decode()
        if kind not in self.core.settings.kinds:
            return None
        worker.last_heard = now
        key = raw_key.decode()
        if op == b"claim":
            reply = self._claim_through_gate(worker, kind, key, now, raw_id=raw_id)
            if reply is None:
                return "claim", "ok", b'{"id":' + raw_id + b',"ok":true}\n'
            if isinstance(reply, WaitingReply):
                return "claim", "", reply
            return "claim", reply["error"], encode_line(reply)
        waiting = self._waiting.get((kind, key))
        if waiting is not None:
            return "release", "", self._behind(waiting, "release", None, raw_id)
        if self.core.release(worker, kind, key, now):
            self._released(kind, key)
            return "release", "ok", b'{"id":' + raw_id + b',"ok":true}\n'
        return "release", "not_holder", encode_line(not_holder(json.loads(raw_id)))

    def settle(self, waiting: WaitingReply, now: float) -> tuple[str, str, bytes]:
        """Apply a waiting reply whose gate answered, once every reply before it on the
        connection was applied; returns its op, its result and the reply line. A claim
        the directory took is claimed in the local table now, unless its lease was
        retired meanwhile; one of a connection closed meanwhile still is (the worker is
        lost, and may say hello again)."""
        if waiting.op == "sync":
            result, reply = self._settle_sync(waiting)
            return "sync", result, encode_line(reply)
        if waiting.op == "release":
            return "release", *self._settle_release(waiting, now)
        return "claim", *self._settle_claim(waiting, now)

    def closed(self, now: float) -> Worker | None:
        """The connection went away. Returns the worker whose lease it was, now lost."""
        worker, self.worker = self.worker, None
        if worker is None or worker.lease is not self:
            return None
        worker.lease = None
        if worker.state is WorkerState.LIVE:
            self.core.lose(worker, now)
            return worker
        return None

    # -- hello -------------------------------------------------------------

    def _hello(self, request: dict[str, Any], now: float) -> Reply:
        rid = request.get("id")
        version = request.get("v")
        if isinstance(version, bool) or version != PROTOCOL_VERSION:  # True == 1 in Python
            return error_reply(rid, "unsupported_version", "This router speaks version 1.")
        worker_id, url, boot = request.get("worker"), request.get("url"), request.get("boot")
        if not isinstance(worker_id, str) or not _WORKER_ID.fullmatch(worker_id):
            return error_reply(rid, "bad_request", "`worker` must be 1-64 of [A-Za-z0-9._:-].")
        if isinstance(url, str) and url.startswith("http:"):
            url = url.rstrip("/")  # as a base URL is often written; the config's has none
        address = parse_upstream(url) if isinstance(url, str) else "it is not a string"
        if isinstance(address, str):
            return error_reply(
                rid, "bad_request", f"`url` must be http://host:port or unix:/path: {address}."
            )
        assert isinstance(url, str)
        if not isinstance(boot, str) or not valid_boot(boot):
            return error_reply(
                rid, "bad_request", "`boot` must be 1-128 visible ASCII characters, no spaces."
            )
        refusal = self._hello_refusal(request, worker_id, address, boot)
        if refusal is not None:
            return error_reply(rid, *refusal)
        if self.worker is not None and self.worker.id != worker_id:
            return error_reply(rid, "forbidden", "This connection already holds another lease.")
        # Started by this router's `spawn:`, or adopted from its last run.
        spawned = worker_id in self.policy.spawned_ids
        origin = WorkerOrigin.SPAWNED if spawned else WorkerOrigin.CONTROL
        before = self.core.workers.get(worker_id)
        # A hello again, or one taking the lease over, changes no state: not a transition.
        self.became_live = before is None or before.state is not WorkerState.LIVE
        worker = self.core.register(worker_id, url, origin, now, boot)
        self.worker = worker
        worker.lease = self
        self._sync_pending = None  # a sync left unfinished before this hello is void
        reply: Reply = {"id": rid, "ok": True, "router": self.policy.router_boot}
        prefix = self.gate.key_prefix() if self.gate is not None else None
        if prefix is not None:
            reply["key_prefix"] = prefix  # for the keys this worker mints (design §10)
        return reply

    def _hello_refusal(
        self, request: dict[str, Any], worker_id: str, address: UpstreamAddress, boot: str
    ) -> tuple[str, str] | None:
        policy = self.policy
        if self.peer.tcp:
            auth = request.get("auth")
            if (
                policy.secret is None
                or not isinstance(auth, str)
                or not hmac.compare_digest(auth.encode(), policy.secret.encode())
            ):
                return "forbidden", "A hello over TCP needs the shared secret in `auth`."
        elif self.peer.uid is not None and self.peer.uid not in (
            policy.allowed_uids | {policy.own_uid}
        ):
            return "forbidden", "This uid may not register workers."
        owners = None if self.peer.tcp or self.peer.uid is None else frozenset({self.peer.uid})
        if (refused := policy.worker_url_refusal(address, owners)) is not None:
            return "forbidden", refused
        # Every worker at this address, not just the first: a lost one may share it with a
        # live one. Compared as addresses, not text: `localhost` and 127.0.0.1, or a port
        # written with a leading zero, must not let a worker take another's traffic.
        for holder in self.core.workers:
            if holder.id != worker_id and holder.state is WorkerState.LIVE and _at(holder, address):
                return "worker_busy", f"Another live worker ({holder.id}) has this url."
        existing = self.core.workers.get(worker_id)
        if existing is not None and existing.origin is WorkerOrigin.STATIC:
            # The config's id, probed at the config's url: a hello would retire it (its
            # sessions 410) and send its traffic wherever the hello says.
            return "worker_busy", "A static worker (the config's `workers:`) has this id."
        if worker_id in policy.probed_ids:
            # The same for a worker the router spawns and probes: it never says hello.
            return "worker_busy", "A probed spawned worker (spawn.register: probe) has this id."
        # This connection's own lease too: a second hello on it with another boot or url
        # would retire the worker it speaks for (and close this very connection).
        if (
            existing is not None
            and existing.state is WorkerState.LIVE
            and (existing.boot != boot or parse_upstream(existing.url) != address)
        ):
            return "worker_busy", "A live worker with this id holds the lease."
        return None

    # -- claims --------------------------------------------------------------

    def _kind_and_key(
        self, request: dict[str, Any], *, releasing: bool = False
    ) -> tuple[str, str] | Reply:
        rid = request.get("id")
        kind = request.get("kind", "episode")
        key = request.get("key")
        if not isinstance(kind, str):
            return error_reply(rid, "bad_request", "`kind` must be a string.")
        # A release may name a kind a reload removed: the worker still holds the claim
        # (the table is left as it was), and must be able to end it.
        held_before = (
            releasing and isinstance(key, str) and self.core.claims.lookup(kind, key) is not None
        )
        if kind not in self.core.settings.kinds and not held_before:
            return error_reply(rid, "unknown_kind", f"No session kind named {kind!r}.")
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS:
            return error_reply(rid, "bad_request", "`key` must be a non-empty string.")
        return kind, key

    def _claim(self, request: dict[str, Any], now: float) -> Reply | WaitingReply:
        parsed = self._kind_and_key(request)
        if isinstance(parsed, dict):
            return parsed
        assert self.worker is not None
        if self.gate is not None:
            rid = request.get("id")
            reply = self._claim_through_gate(self.worker, *parsed, now, request_id=rid)
            return {"id": rid, "ok": True} if reply is None else reply
        if self._over_claim_cap(self.worker, *parsed):
            return self._too_many(request.get("id"))
        refusal = self.core.claim(self.worker, *parsed, now)
        if refusal is None:
            return {"id": request.get("id"), "ok": True}
        return claim_refused(request.get("id"), refusal)

    def _release(self, request: dict[str, Any], now: float) -> Reply | WaitingReply:
        parsed = self._kind_and_key(request, releasing=True)
        if isinstance(parsed, dict):
            return parsed
        assert self.worker is not None
        waiting = self._waiting.get(parsed)
        if waiting is not None:
            return self._behind(waiting, "release", request.get("id"))
        if self.core.release(self.worker, *parsed, now):
            self._released(*parsed)
            return {"id": request.get("id"), "ok": True}
        return not_holder(request.get("id"))

    # -- claims through the claims directory (design §10) ----------------------

    def _claim_through_gate(
        self,
        worker: Worker,
        kind: str,
        key: str,
        now: float,
        request_id: object = None,
        raw_id: bytes = b"",
    ) -> Reply | WaitingReply | None:
        """A claim with a gate: answered at once from the local table when it knows the
        key (held by this worker: None, for an ok reply; else its refusal), else
        waiting for the gate. The id is `raw_id`'s JSON text when given."""
        waiting = self._waiting.get((kind, key))
        if waiting is not None:  # a claim again of a key whose claim waits
            return self._behind(waiting, "claim", request_id, raw_id)
        claims = self.core.claims
        if claims.lookup(kind, key) is not None:
            refusal = self.core.claim(worker, kind, key, now)
            if refusal is None:
                return None
            return claim_refused(_request_id(request_id, raw_id), refusal)
        # The cap counts the claims waiting for the gate: each may become held.
        held = claims.held_count(worker.id) + len(self._waiting)
        if held >= self.policy.max_claims_per_worker:
            return self._too_many(_request_id(request_id, raw_id))
        pair = (kind, key)
        waiting = WaitingReply(
            "claim", request_id, worker, (pair,), kind=kind, key=key, raw_id=raw_id
        )
        self._waiting[pair] = waiting
        return waiting

    def _behind(
        self, leader: WaitingReply, op: str, request_id: object, raw_id: bytes = b""
    ) -> WaitingReply:
        """A release or claim of the key `leader` claims, applied after it."""
        return WaitingReply(
            op,
            request_id,
            leader.worker,
            (),
            kind=leader.kind,
            key=leader.key,
            leader=leader,
            raw_id=raw_id,
        )

    def _released(self, kind: str, key: str) -> None:
        """The local table accepted a release: the directory marks the record ended."""
        if self.gate is not None:
            self.gate.released(kind, key)

    def _settle_claim(self, waiting: WaitingReply, now: float) -> tuple[str, bytes]:
        kind, key = waiting.kind, waiting.key
        if self._waiting.get((kind, key)) is waiting:
            del self._waiting[kind, key]
        leader = waiting.leader
        answer = waiting.answer if leader is None else leader.answer
        if not waiting.lease_current():
            if leader is None and isinstance(answer, tuple) and answer[0].verdict is _CLAIMED:
                # Written for a lease that is gone: the record must not stay held for a
                # claim no worker was told of.
                self._released(kind, key)
            return "no_hello", encode_line(lease_ended(waiting.request_id))
        if leader is None or self.core.claims.lookup(kind, key) is None:
            if not isinstance(answer, tuple):
                return "directory_unavailable", encode_line(
                    directory_unavailable(waiting.request_id)
                )
            outcome = answer[0]
            if outcome.verdict is not _CLAIMED:
                return outcome.verdict.value, encode_line(
                    directory_refusal(waiting.request_id, outcome)
                )
        # The directory holds it for this router: the local table decides between its
        # workers (another may have claimed it while this one waited).
        refusal = self.core.claim(waiting.worker, kind, key, now)
        if refusal is None:
            return "ok", waiting.ok_line()
        return refusal.error, encode_line(claim_refused(waiting.request_id, refusal))

    def _settle_release(self, waiting: WaitingReply, now: float) -> tuple[str, bytes]:
        if not waiting.lease_current():
            return "no_hello", encode_line(
                error_reply(waiting.request_id, "no_hello", "Say hello first.")
            )
        if self.core.release(waiting.worker, waiting.kind, waiting.key, now):
            self._released(waiting.kind, waiting.key)
            return "ok", waiting.ok_line()
        return "not_holder", encode_line(not_holder(waiting.request_id))

    def _settle_sync(self, waiting: WaitingReply) -> tuple[str, Reply]:
        rid, answer = waiting.request_id, waiting.answer
        if not isinstance(answer, tuple):
            # The local claims stay: the router writes its table back to the directory
            # once it answers again.
            return "directory_unavailable", directory_unavailable(rid)
        refusals = waiting.refusals
        assert refusals is not None
        accepted = waiting.accepted
        current = waiting.lease_current()
        for (kind, key), outcome in zip(waiting.asks, answer, strict=True):
            if outcome.verdict is _CLAIMED:
                continue
            # Another router holds it, or it ended or exited there: not this worker's,
            # and no local tombstone may answer for it.
            if current:
                self.core.forget(waiting.worker, kind, key)
            accepted -= 1
            refusals.add({"kind": kind, "key": key, "error": outcome.verdict.value})
        return "ok", refusals.reply(rid, accepted, more=False)

    def _sync(self, request: dict[str, Any], now: float) -> Reply | WaitingReply:
        rid = request.get("id")
        entries, more = request.get("claims"), request.get("more", False)
        if not isinstance(entries, list) or not isinstance(more, bool):
            return error_reply(rid, "bad_request", "`claims` must be a list, `more` a boolean.")
        pending = self._sync_pending if self._sync_pending is not None else set()
        # Refusals go in this message's reply, as many as fit in one line: a peer
        # cannot grow what the router keeps, nor make a reply it cannot read.
        refusals = SyncRefusals(rid)
        for entry in entries:
            parsed = self._kind_and_key(entry) if isinstance(entry, dict) else None
            if isinstance(parsed, tuple):
                pending.add(parsed)
            elif refusals.full:
                refusals.omitted += 1
            else:
                refusals.add(refused_sync_entry(entry, parsed))
        if len(pending) > self.policy.max_claims_per_worker:
            # Refused whole, the keys it held so far dropped: applying part of a set
            # would end claims the worker still means to hold.
            self._sync_pending = None
            return self._too_many(rid)
        if more:
            self._sync_pending = pending
            return refusals.reply(rid, 0, more=True)
        self._sync_pending = None
        worker = self.worker
        assert worker is not None
        held_before = self._held_keys(worker) if self.gate is not None else set()
        result = self.core.sync(worker, pending, now)
        for listed, (kind, key, why) in enumerate(result.refused):
            if refusals.full:  # the rest are only counted
                refusals.omitted += len(result.refused) - listed
                break
            refusals.add({"kind": kind, "key": key, "error": why.error})
        if self.gate is None:
            return refusals.reply(rid, result.accepted, more=False)
        refused = {(kind, key) for kind, key, _why in result.refused}
        return self._sync_through_gate(
            worker, rid, held_before, pending - refused, result.accepted, refusals
        )

    def _sync_through_gate(
        self,
        worker: Worker,
        rid: object,
        held_before: set[tuple[str, str]],
        accepted: set[tuple[str, str]],
        accepted_count: int,
        refusals: SyncRefusals,
    ) -> Reply | WaitingReply:
        """A sync applied locally, with a gate: the keys it no longer lists are released
        in the directory, and those it newly holds are claimed there before the reply
        (after a router restart the directory may hold them for this router already:
        the gate answers CLAIMED for those)."""
        for kind, key in held_before - accepted:
            self._released(kind, key)  # no longer listed: ended
        new = tuple(sorted(accepted - held_before))
        if not new:
            return refusals.reply(rid, accepted_count, more=False)
        waiting = WaitingReply("sync", rid, worker, new)
        waiting.refusals = refusals
        waiting.accepted = accepted_count
        return waiting

    def _held_keys(self, worker: Worker) -> set[tuple[str, str]]:
        return {(claim.kind, claim.key) for claim in self.core.claims.held_by(worker.id)}

    def _over_claim_cap(self, worker: Worker, kind: str, key: str) -> bool:
        """True when claiming `key` would make `worker` hold more than its cap: a key it
        holds already, or one the core would refuse anyway, is answered as usual."""
        claims = self.core.claims
        if claims.held_count(worker.id) < self.policy.max_claims_per_worker:
            return False
        return claims.lookup(kind, key) is None

    def _too_many(self, request_id: object) -> Reply:
        limit = self.policy.max_claims_per_worker
        return error_reply(
            request_id,
            "too_many_claims",
            f"This worker may hold at most {limit} claims (control.max_claims_per_worker).",
            limit=limit,
        )

    # -- the rest --------------------------------------------------------------

    def _drain(self, request: dict[str, Any], now: float) -> Reply:
        on = request.get("on", True)
        if not isinstance(on, bool):
            return error_reply(request.get("id"), "bad_request", "`on` must be a boolean.")
        assert self.worker is not None
        self.core.set_draining(self.worker, on, by_worker=True)
        return {"id": request.get("id"), "ok": True}

    def _bye(self, request: dict[str, Any], now: float) -> Reply:
        worker, self.worker = self.worker, None
        self._sync_pending = None
        assert worker is not None
        worker.lease = None
        self.core.retire(worker, now)
        return {"id": request.get("id"), "ok": True}

    def _ping(self, request: dict[str, Any], now: float) -> Reply:
        return {"id": request.get("id"), "ok": True}

    _HANDLERS: dict[
        str, Callable[[ControlSession, dict[str, Any], float], Reply | WaitingReply]
    ] = {
        "hello": _hello,
        "claim": _claim,
        "release": _release,
        "sync": _sync,
        "drain": _drain,
        "bye": _bye,
        "ping": _ping,
    }


def _at(worker: Worker, address: UpstreamAddress) -> bool:
    """True when `worker`'s url may name the socket `address` names."""
    own = parse_upstream(worker.url)  # checked when registered; a journal's is trusted less
    return not isinstance(own, str) and same_upstream(own, address)
