"""The control protocol (DESIGN §3): the line codec and one connection's session.

`decode_line` turns one NDJSON line into a request or an error reply;
`ControlSession` applies requests to the `RouterCore` on behalf of the worker
that said hello on this connection and returns the reply for each. Neither
reads a socket or a clock: the server in `control_server` does the I/O.

Malformed input is answered, never raised: a bad line gets `bad_request`, an
unknown op `unknown_op`, and the connection goes on.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router.core import RouterCore
from router.workers import Worker, WorkerOrigin, WorkerState

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 1 << 20  # DESIGN §3: a line over 1 MiB closes the connection
MAX_KEY_CHARS = 512  # longer than any key a token or cookie can carry
SYNC_MAX_PENDING = 2_000_000  # bound on claims one sync may span, across its messages
_WORKER_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

Reply = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is on the other end, as the transport tells."""

    uid: int | None  # SO_PEERCRED uid for Unix sockets; None over TCP
    tcp: bool
    pid: int | None = None  # SO_PEERCRED pid: lets the router stop an adopted worker


@dataclass(frozen=True, slots=True)
class ControlPolicy:
    """Who may say hello (DESIGN §3 'Who may say hello')."""

    own_uid: int
    allowed_uids: frozenset[int]
    allowed_upstreams: frozenset[str]
    secret: str | None
    router_boot: str


def encode(reply: Reply) -> bytes:
    """One reply line."""
    return json.dumps(reply, separators=(",", ":")).encode() + b"\n"


def error_reply(request_id: object, error: str, detail: str, **extra: Any) -> Reply:
    return {"id": request_id, "ok": False, "error": error, "detail": detail, **extra}


def decode_line(line: bytes) -> dict[str, Any] | Reply:
    """Parse one line into a request dict with a valid `id` and string `op`.

    Returns the request, or (when `"ok"` is in the result) the error reply.
    """
    try:
        # Decode first: json.loads(bytes) would also take UTF-16/32 and a BOM.
        message = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        return error_reply(None, "bad_request", "The line is not a JSON object.")
    if not isinstance(message, dict):
        return error_reply(None, "bad_request", "The line is not a JSON object.")
    request_id = message.get("id")
    if request_id is not None and (
        isinstance(request_id, bool) or not isinstance(request_id, (str, int))
    ):
        return error_reply(None, "bad_request", "`id` must be a string or an integer.")
    if "ok" in message:
        return error_reply(request_id, "bad_request", "Requests carry no `ok` field.")
    if not isinstance(message.get("op"), str):
        return error_reply(request_id, "bad_request", "`op` must be a string.")
    return message


def is_loopback_url(url: str) -> bool:
    """True for `unix:` paths and http URLs on a loopback address."""
    if url.startswith("unix:"):
        return True
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def valid_upstream_url(url: str) -> bool:
    """`http://host:port` or `unix:/path`, nothing else."""
    if url.startswith("unix:"):
        return url.startswith("unix:/") and "\x00" not in url  # absolute: cwds differ
    if not url.isascii() or not url.isprintable() or " " in url:
        return False  # urlsplit silently drops tabs and newlines; the url must be taken as is
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    return (
        parts.scheme == "http"
        and bool(parts.hostname)
        and bool(port)  # None or 0: nothing to connect to
        and parts.path in ("", "/")
        and not parts.query
        and not parts.fragment
        and parts.username is None
    )


class ControlSession:
    """One control connection: at most one worker's lease."""

    def __init__(self, core: RouterCore, policy: ControlPolicy, peer: Peer) -> None:
        self.core = core
        self.policy = policy
        self.peer = peer
        self.worker: Worker | None = None
        self._sync_pending: set[tuple[str, str]] | None = None
        self._sync_refused: list[Reply] = []

    def handle(self, request: dict[str, Any], now: float) -> Reply:
        """Apply one decoded request and return its reply."""
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
        if not isinstance(url, str) or not valid_upstream_url(url):
            return error_reply(rid, "bad_request", "`url` must be http://host:port or unix:/path.")
        if url.startswith("http:"):
            url = url.rstrip("/")  # one spelling per address, for the uniqueness check
        if not isinstance(boot, str) or not 1 <= len(boot) <= 128:
            return error_reply(rid, "bad_request", "`boot` must be a string of 1-128 chars.")
        refusal = self._hello_refusal(request, worker_id, url, boot)
        if refusal is not None:
            return error_reply(rid, *refusal)
        if self.worker is not None and self.worker.id != worker_id:
            return error_reply(rid, "forbidden", "This connection already holds another lease.")
        existing = self.core.workers.get(worker_id)
        worker = self.core.register(worker_id, url, self._origin(existing), now, boot)
        self.worker = worker
        worker.lease = self
        return {"id": rid, "ok": True, "router": self.policy.router_boot}

    def _hello_refusal(
        self, request: dict[str, Any], worker_id: str, url: str, boot: str
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
        if not is_loopback_url(url) and url not in policy.allowed_upstreams:
            return "forbidden", "The url is not loopback and not in control.allowed_upstreams."
        # Every worker with this url, not just the first: a lost one may share it with a live one.
        for holder in self.core.workers:
            if holder.url == url and holder.id != worker_id and holder.state is WorkerState.LIVE:
                return "worker_busy", f"Another live worker ({holder.id}) has this url."
        existing = self.core.workers.get(worker_id)
        if (
            existing is not None
            and existing.state is WorkerState.LIVE
            and existing.origin is not WorkerOrigin.STATIC
            and (existing.boot != boot or existing.url != url)
            and self.worker is not existing
        ):
            return "worker_busy", "A live worker with this id holds the lease."
        return None

    def _origin(self, existing: Worker | None) -> WorkerOrigin:
        if existing is not None and existing.origin is WorkerOrigin.SPAWNED:
            return WorkerOrigin.SPAWNED
        return WorkerOrigin.CONTROL

    # -- claims --------------------------------------------------------------

    def _kind_and_key(self, request: dict[str, Any]) -> tuple[str, str] | Reply:
        rid = request.get("id")
        kind = request.get("kind", "episode")
        key = request.get("key")
        if not isinstance(kind, str):
            return error_reply(rid, "bad_request", "`kind` must be a string.")
        if kind not in self.core.settings.kinds:
            return error_reply(rid, "unknown_kind", f"No session kind named {kind!r}.")
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS:
            return error_reply(rid, "bad_request", "`key` must be a non-empty string.")
        return kind, key

    def _claim(self, request: dict[str, Any], now: float) -> Reply:
        parsed = self._kind_and_key(request)
        if isinstance(parsed, dict):
            return parsed
        assert self.worker is not None
        refusal = self.core.claim(self.worker, *parsed, now)
        if refusal is None:
            return {"id": request.get("id"), "ok": True}
        extra = {"holder": refusal.holder} if refusal.holder is not None else {}
        return error_reply(
            request.get("id"), refusal.error, _REFUSAL_DETAIL[refusal.error], **extra
        )

    def _release(self, request: dict[str, Any], now: float) -> Reply:
        parsed = self._kind_and_key(request)
        if isinstance(parsed, dict):
            return parsed
        assert self.worker is not None
        if self.core.release(self.worker, *parsed, now):
            return {"id": request.get("id"), "ok": True}
        return error_reply(request.get("id"), "not_holder", "Another worker holds this key.")

    def _sync(self, request: dict[str, Any], now: float) -> Reply:
        rid = request.get("id")
        entries, more = request.get("claims"), request.get("more", False)
        if not isinstance(entries, list) or not isinstance(more, bool):
            return error_reply(rid, "bad_request", "`claims` must be a list, `more` a boolean.")
        pending = self._sync_pending if self._sync_pending is not None else set()
        for entry in entries:
            parsed = self._kind_and_key(entry) if isinstance(entry, dict) else None
            if isinstance(parsed, tuple):
                pending.add(parsed)
            else:
                self._sync_refused.append(_refused_entry(entry, parsed))
        if len(pending) > SYNC_MAX_PENDING:
            self._sync_pending, self._sync_refused = None, []
            return error_reply(rid, "bad_request", "The sync lists too many claims.")
        if more:
            self._sync_pending = pending
            return {"id": rid, "ok": True, "accepted": 0, "refused": [], "more": True}
        assert self.worker is not None
        result = self.core.sync(self.worker, pending, now)
        refused = self._sync_refused + [
            {"kind": kind, "key": key, "error": why.error} for kind, key, why in result.refused
        ]
        self._sync_pending, self._sync_refused = None, []
        return {"id": rid, "ok": True, "accepted": result.accepted, "refused": refused}

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
        assert worker is not None
        worker.lease = None
        self.core.retire(worker, now)
        return {"id": request.get("id"), "ok": True}

    def _ping(self, request: dict[str, Any], now: float) -> Reply:
        return {"id": request.get("id"), "ok": True}

    _HANDLERS: dict[str, Callable[[ControlSession, dict[str, Any], float], Reply]] = {
        "hello": _hello,
        "claim": _claim,
        "release": _release,
        "sync": _sync,
        "drain": _drain,
        "bye": _bye,
        "ping": _ping,
    }


_REFUSAL_DETAIL = {
    "conflict": "Another live worker holds this key.",
    "ended": "This key ended; a new attempt needs a new key.",
    "worker_exited": "The worker that held this key exited; a new attempt needs a new key.",
}


def _refused_entry(entry: object, error: Reply | None) -> Reply:
    if isinstance(entry, dict):
        kind, key = entry.get("kind", "episode"), entry.get("key")
    else:
        kind, key = None, None
    code = error["error"] if error is not None else "bad_request"
    return {"kind": kind, "key": key, "error": code}
