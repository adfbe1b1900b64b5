"""A scripted router for control-client tests: the router's side of design §3, on real sockets.

`ScriptedRouter` is the router's side of the control contract, written small and
from the contract alone: hello with its refusals, a claim table with conflicts
and tombstones, release, multi-message sync, drain, bye, ping, and the bad-line
replies. Tests drive it (drop connections, restart it with a new router id, make
it go silent) and assert what crossed the wire. It never imports the router's
own control server: it checks the client against the contract, not against our
implementation of it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Message = dict[str, Any]
Pair = tuple[str, str]
# The session kinds this router is configured with; any other `kind` is `unknown_kind`.
KINDS = ("episode", "mcp_session")
# The contract's line limit: a longer line closes the connection.
LINE_LIMIT = 1 << 20


class _Session:
    """One connection's lease, as the router sees it."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.worker: str | None = None
        self.messages: list[Message] = []
        self.sync_pending: set[Pair] = set()
        self.sync_refused: list[Message] = []


class ScriptedRouter:
    """The router side of the control socket, faithful to the contract, with test levers."""

    def __init__(self, path: Path, *, router_id: str = "r1", secret: str | None = None) -> None:
        self.path = path
        self.router_id = router_id
        self.secret = secret
        self.tcp_port = 0
        self.sessions: list[_Session] = []
        self.arrivals: list[tuple[float, Message]] = []
        self.holders: dict[Pair, str] = {}
        self.tombstones: dict[Pair, str] = {}  # pair -> "ended" | "worker_exited"
        self.boots: dict[str, str] = {}
        self.drained: dict[str, bool] = {}
        self.silent = False
        self.hangups_after_hello = 0  # this many connections are closed right after their hello
        self.key_prefix: object = None  # offered in the hello reply when not None
        self._servers: list[asyncio.Server] = []

    # -- levers --

    async def start(self, *, tcp: bool = False) -> None:
        """Listen on the Unix path, or with tcp=True on a loopback port (`tcp_port`)."""
        if tcp:
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=LINE_LIMIT)
            self.tcp_port = server.sockets[0].getsockname()[1]
        else:
            server = await asyncio.start_unix_server(self._serve, str(self.path), limit=LINE_LIMIT)
        self._servers.append(server)

    async def drop_connections(self) -> None:
        """Close every live connection; the listener stays up."""
        for session in self.sessions:
            session.writer.close()
        await asyncio.sleep(0)

    def inject(self, raw: bytes) -> None:
        """Write `raw` on every live connection, as if the router had sent it."""
        for session in self.sessions:
            if not session.writer.is_closing():
                session.writer.write(raw)

    async def close(self) -> None:
        """Stop listening, close every connection and remove the socket file."""
        for server in self._servers:
            server.close()
        await self.drop_connections()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
        self.path.unlink(missing_ok=True)

    async def restart(self, router_id: str) -> None:
        """A router restart without a journal: a new id and an empty table."""
        await self.close()
        self.router_id = router_id
        self.holders.clear()
        self.tombstones.clear()
        self.boots.clear()
        self.drained.clear()
        await self.start()

    # -- what arrived --

    @property
    def messages(self) -> list[Message]:
        """Every parsed request, in arrival order across connections."""
        return [message for _, message in self.arrivals]

    def ops(self, session: int | None = None) -> list[str]:
        """The ops that arrived, on every connection or on the `session`-th one."""
        source = self.messages if session is None else self.sessions[session].messages
        return [message["op"] for message in source]

    def held_by(self, worker: str) -> set[Pair]:
        """The (kind, key) pairs the table says `worker` holds."""
        return {pair for pair, holder in self.holders.items() if holder == worker}

    # -- the protocol --

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = _Session(writer)
        self.sessions.append(session)
        try:
            while line := await reader.readline():
                reply = self._reply(session, line)
                if not self.silent:
                    writer.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
                if self.hangups_after_hello and session.worker and len(session.messages) == 1:
                    self.hangups_after_hello -= 1
                    return
        except (ValueError, ConnectionError):  # a line over the limit closes the connection
            pass
        finally:
            writer.close()

    def _reply(self, session: _Session, line: bytes) -> Message:
        try:
            message = json.loads(line)
        except ValueError:
            return {"id": None, "ok": False, "error": "bad_request"}
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            return {"id": None, "ok": False, "error": "bad_request"}
        self.arrivals.append((time.monotonic(), message))
        session.messages.append(message)
        rid = message.get("id")
        handler = getattr(self, f"_op_{message['op']}", None)
        if handler is None:
            return {"id": rid, "ok": False, "error": "unknown_op"}
        if message["op"] != "hello" and session.worker is None:
            return {"id": rid, "ok": False, "error": "no_hello"}
        result: Message = handler(session, message)
        return {"id": rid, **result}

    def _op_hello(self, session: _Session, message: Message) -> Message:
        if message.get("v") != 1:
            return {"ok": False, "error": "unsupported_version"}
        if self.secret is not None and not hmac.compare_digest(
            str(message.get("auth", "")), self.secret
        ):
            return {"ok": False, "error": "forbidden"}
        worker, boot = message["worker"], message["boot"]
        live = any(s.worker == worker and not s.writer.is_closing() for s in self.sessions)
        if live and self.boots.get(worker) != boot:
            return {"ok": False, "error": "worker_busy"}
        if worker in self.boots and self.boots[worker] != boot:
            self._retire(worker, "worker_exited")
        self.boots[worker] = boot
        session.worker = worker
        reply: Message = {"ok": True, "router": self.router_id}
        if self.key_prefix is not None:
            reply["key_prefix"] = self.key_prefix
        return reply

    def _pair(self, message: Message) -> Pair | Message:
        kind, key = message.get("kind", "episode"), message.get("key")
        if kind not in KINDS:
            return {"ok": False, "error": "unknown_kind"}
        if not isinstance(key, str) or not key:
            return {"ok": False, "error": "bad_request"}
        return kind, key

    def _refusal(self, worker: str, pair: Pair) -> Message | None:
        if pair in self.tombstones:
            return {"ok": False, "error": self.tombstones[pair]}
        holder = self.holders.get(pair)
        if holder is not None and holder != worker:
            return {"ok": False, "error": "conflict", "holder": holder}
        return None

    def _op_claim(self, session: _Session, message: Message) -> Message:
        pair = self._pair(message)
        if isinstance(pair, dict):
            return pair
        assert session.worker is not None
        refusal = self._refusal(session.worker, pair)
        if refusal is not None:
            return refusal
        self.holders[pair] = session.worker
        return {"ok": True}

    def _op_release(self, session: _Session, message: Message) -> Message:
        pair = self._pair(message)
        if isinstance(pair, dict):
            return pair
        holder = self.holders.get(pair)
        if holder is not None and holder != session.worker:
            return {"ok": False, "error": "not_holder"}
        if holder is not None:
            del self.holders[pair]
            self.tombstones[pair] = "ended"
        return {"ok": True}

    def _op_sync(self, session: _Session, message: Message) -> Message:
        assert session.worker is not None
        for entry in message["claims"]:
            pair = self._pair(entry)
            if isinstance(pair, dict):
                session.sync_refused.append({**entry, "error": pair["error"]})
            else:
                session.sync_pending.add(pair)
        if message.get("more"):
            return {"ok": True, "accepted": 0, "refused": []}
        listed, refused = session.sync_pending, session.sync_refused
        session.sync_pending, session.sync_refused = set(), []
        for pair in self.held_by(session.worker) - listed:
            del self.holders[pair]
            self.tombstones[pair] = "ended"
        accepted = 0
        for pair in sorted(listed):
            refusal = self._refusal(session.worker, pair)
            if refusal is None:
                self.holders[pair] = session.worker
                accepted += 1
            else:
                refused.append({"kind": pair[0], "key": pair[1], "error": refusal["error"]})
        return {"ok": True, "accepted": accepted, "refused": refused}

    def _op_drain(self, session: _Session, message: Message) -> Message:
        assert session.worker is not None
        self.drained[session.worker] = bool(message.get("on", True))
        return {"ok": True}

    def _op_bye(self, session: _Session, message: Message) -> Message:
        assert session.worker is not None
        self._retire(session.worker, "worker_exited")
        session.worker = None
        return {"ok": True}

    def _op_ping(self, session: _Session, message: Message) -> Message:
        return {"ok": True}

    def _retire(self, worker: str, why: str) -> None:
        for pair in self.held_by(worker):
            del self.holders[pair]
            self.tombstones[pair] = why


async def eventually(check: Callable[[], bool], *, within: float = 5.0) -> None:
    """Wait (bounded) until `check()` holds."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
