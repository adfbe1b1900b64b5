"""The lean forwarding path: requests relayed to workers over the router's own pools.

This module owns one forward from end to end: the pool for its worker, the request
written (head and body in one write when the body is small and already here, else the
head then the body streamed: `router.relay.upload`), the wait for the reply head, one
retry of an idempotent request whose pooled connection turns out stale, the observer's
look at the reply, and the choice between relaying the reply whole or streaming it
(`router.relay.reply`). A forward that can go at once starts on the lane, with no task
(`start`; `router.relay.lane` carries it on), and is handed back to the coroutine path
here when anything but a whole reply comes. It keeps the interface of `router.relay.contract`
(the same `Upstream`, `ForwardTimeouts`, `UpstreamFailure`, `ReplyObserver` and header
rules) with aiohttp's client replaced by `router.relay.pool` (connections),
`router.relay.wire` (request bytes) and `router.relay.reply_parser` (reply bytes, llhttp).

It never decides where a request goes and never writes an answer of its own: a
failure before the reply head reached the client is raised as `UpstreamFailure` for
the public handler to translate, and a failure after it aborts the client connection,
so the client sees an incomplete reply rather than a forged clean end.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Coroutine
from typing import Any, Final

from multidict import CIMultiDict

from router.edge import BodyBroken, PublicRequest
from router.relay.budget import BufferBudget
from router.relay.connection import TIMED_OUT, WOKE, WorkerConnection
from router.relay.contract import (
    ALWAYS_END_TO_END,
    BufferLimits,
    ForwardTimeouts,
    ReplyObserver,
    Upstream,
    UpstreamFailure,
    reply_headers_for_client,
    request_headers_for_worker,
    rewrite_location,
)
from router.relay.exchange import Exchange, client_headers, send_whole, stale
from router.relay.lane import Lane, LaneDone, LaneOwner
from router.relay.pool import PoolBusy, PoolClosed, WorkerPool, paced_limit
from router.relay.reply import CLIENT_GONE, log, send_cut, stream_reply
from router.relay.request import WHOLE_BODY_MAX, body_failure, connect_failure, outgoing
from router.relay.upload import start_upload
from router.relay.wire import NO_EXTRA, parse_worker_address

__all__ = [
    "BufferLimits",
    "ForwardTimeouts",
    "Forwarder",
    "LaneDone",
    "ReplyObserver",
    "Upstream",
    "UpstreamFailure",
    "reply_headers_for_client",
    "request_headers_for_worker",
    "rewrite_location",
]


class Forwarder(LaneOwner):
    """Relays requests to workers over keep-alive pools, one pool per worker."""

    def __init__(
        self,
        timeouts: ForwardTimeouts,
        *,
        pool_size_per_upstream: int = 256,
        buffering: BufferLimits = BufferLimits(),  # noqa: B008 (frozen: one shared default)
    ) -> None:
        if pool_size_per_upstream < 1:
            raise ValueError("pool_size_per_upstream must be at least 1")
        # Connections per worker, for the pools opened from now on.
        self.pool_size = pool_size_per_upstream
        self._buffering = buffering
        self.budget = BufferBudget(buffering.budget_bytes)
        # Replies relayed at the client's pace past the pool's share for them: the
        # budget was spent and no paced place freed in time (`_buffer_or_pace`).
        self.paced_over_share = 0
        # ... of which cut: their client took nothing of what was written for
        # `OVER_SHARE_SEND_S` (a connection held past the share is held briefly).
        self.paced_over_share_cut = 0
        # How long a client past the share may take nothing written to it (the tests
        # shorten it).
        self.over_share_send_s = OVER_SHARE_SEND_S
        self._pools: dict[str, WorkerPool] = {}
        self._closed = False
        # The loop, read once when the first pool opens: on Python 3.11 every
        # asyncio.get_running_loop() is a getpid() system call, and the forward built on
        # aiohttp's client made several of them per request; this path makes none.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timeouts = timeouts
        # The request body limit for bodies whose length is not announced (chunked): one
        # with a Content-Length over it was refused before it got here.
        self.max_body_bytes: int | None = None
        # The headers a client's Connection options never remove: the session kinds'
        # (router.relay.contract.end_to_end_headers; set from the config).
        self.end_to_end = ALWAYS_END_TO_END
        # False sends every forward through forward() (the tests compare the two paths).
        self.lane_enabled = True
        # Forwards `start()` took, declined, and handed over to the coroutine path.
        self.lane_started = 0
        self.lane_declined = 0
        self.lane_handovers = 0

    def set_timeouts(self, timeouts: ForwardTimeouts) -> None:
        """Bounds for the forwards that start from now on (a config reload)."""
        self._timeouts = timeouts

    def set_buffering(self, buffering: BufferLimits) -> None:
        """Buffer bounds for the forwards that start from now on (a config reload); bytes
        already reserved stay counted, and so do the paced places already taken."""
        self._buffering = buffering
        self.budget.limit = buffering.budget_bytes
        for pool in self._pools.values():
            pool.paced_limit = paced_limit(pool.limit, buffering.paced_share)

    async def forward(
        self,
        request: PublicRequest,
        upstream: Upstream,
        *,
        extra_headers: dict[str, str] = NO_EXTRA,
        public_base: str | None = None,
        body: bytes | None = None,
        observer: ReplyObserver | None = None,
    ) -> int:
        """Relays `request` to `upstream` and the reply back.

        `body`: the request body when the caller already read it (to find a session in
        it); it is sent as it is. `observer`: shown the reply head (and, if it asks, a
        small body) before anything reaches the client, so a claim learned from a reply
        is in the table before the client can send its next request.

        Returns the reply's status once it was relayed (through the request's connection).
        Raises UpstreamFailure when the forward fails before the reply head was sent to the
        client. After the head went out, a failure aborts the client connection, without a
        clean terminator so the client sees the reply is incomplete, and the status is
        returned all the same.
        """
        exchange = Exchange(request, self._pool_for(upstream))
        try:
            stream = request.body
            # The common small body that came with its head skips this: it goes whole.
            if (
                body is None
                and stream is not None
                and (not stream.complete or stream.received > WHOLE_BODY_MAX)
            ):
                body = await self._gather_body(exchange)
            first, whole = outgoing(
                exchange, extra_headers, body, self.max_body_bytes, self.end_to_end
            )
            await self._send(exchange, first, whole)
            if exchange.reserved:  # a body buffered whole, now the worker's: budget free
                self._give_back(exchange)
            return await self._relay(exchange, public_base, observer)
        finally:
            self._let_go(exchange)

    async def accepts_connections(self, upstream: Upstream) -> bool:
        """Whether `upstream` takes a new connection now, within the connect timeout,
        nothing sent on it: after a forward failed, it tells a far side that is gone
        (refused, or no answer) from one that is up and failed the request."""
        try:
            pool = self._pool_for(upstream)
        except UpstreamFailure:  # shutting down, or an address it cannot reach
            return False
        loop = self._loop
        assert loop is not None
        return await pool.connects(loop.time() + self._timeouts.connect_s)

    def start(
        self,
        request: PublicRequest,
        upstream: Upstream,
        on_done: LaneDone,
        *,
        extra_headers: dict[str, str] = NO_EXTRA,
        public_base: str | None = None,
        body: bytes | None = None,
        observer: ReplyObserver | None = None,
        observed_status: int = 0,
    ) -> bool:
        """`forward()` with no task, no coroutine and no future, when the request can go
        at once: its body all here and small, and an idle connection to the worker at
        hand. False when it cannot (nothing was done: `forward()` it instead).

        `observer` sees only a reply whose status is `observed_status` (a peer hop's
        421, which may have to be held back): such a reply, and any the lane does not
        relay whole, goes the coroutine path, shown to `observer` as `forward()` shows
        it. Any other reply is relayed unseen.

        `on_done.lane_done` is called once: with the status, when the reply came whole and was
        relayed (the usual tool call), or with a coroutine that finishes the forward as
        `forward()` would (the status, or UpstreamFailure) for the caller to run, when
        anything else happens (a reply to stream, a stale connection, a timeout, the
        client leaving). It may be called from inside a worker connection's callback.

        Callbacks instead of an edge task, a coroutine chain and two futures per request
        (measured with the edge's synchronous dispatch: docs/performance.md).
        """
        if self.lane_enabled and self._start(
            request, upstream, on_done, extra_headers, public_base, body, observer, observed_status
        ):
            self.lane_started += 1
            return True
        self.lane_declined += 1
        return False

    def _start(
        self,
        request: PublicRequest,
        upstream: Upstream,
        on_done: LaneDone,
        extra_headers: dict[str, str],
        public_base: str | None,
        body: bytes | None,
        observer: ReplyObserver | None,
        observed_status: int,
    ) -> bool:
        if request.method == "CONNECT" or not request.body_complete:
            return False
        pool = self._pools.get(upstream.worker_id)
        if pool is None or pool.url != upstream.url:
            return False  # forward() opens (or replaces) the pool
        exchange = Exchange(request, pool)
        try:
            message, whole = outgoing(
                exchange, extra_headers, body, self.max_body_bytes, self.end_to_end
            )
        except UpstreamFailure:
            return False  # forward() meets the same failure and raises it
        if not whole:
            return False
        conn = pool.take_idle()
        if conn is None:
            return False
        exchange.conn = conn
        request.on_client_lost = exchange
        self._write_request(exchange, conn, message)
        lane = Lane(self, exchange, message, public_base, on_done, observer, observed_status)
        conn.listen(lane, exchange.deadline)
        return True

    def handed_over(
        self,
        exchange: Exchange,
        message: bytes,
        public_base: str | None,
        observer: ReplyObserver | None,
    ) -> Coroutine[Any, Any, int]:
        """A forward its lane handed over (`Lane`): the rest of it, to run."""
        self.lane_handovers += 1
        return self.resume(exchange, message, public_base, observer)

    async def resume(
        self,
        exchange: Exchange,
        message: bytes,
        public_base: str | None,
        observer: ReplyObserver | None = None,
    ) -> int:
        """The rest of a forward the lane started and handed over (`router.relay.lane.Lane`): as
        `forward()` from the wait for the reply head on."""
        try:
            failure = await self._reply_head_or_retry(exchange, message)
            if failure is not None:
                raise failure
            return await self._relay(exchange, public_base, observer)
        finally:
            self._let_go(exchange)

    def forget(self, worker_id: str) -> None:
        """Closes and drops the pool of `worker_id` (its worker exited); a no-op if unknown.

        Call it from the event loop: its connections close there.
        """
        pool = self._pools.pop(worker_id, None)
        if pool is not None:
            pool.close()

    async def close(self) -> None:
        """Closes every pool; later forwards fail with UpstreamFailure("error")."""
        self._closed = True
        pools = list(self._pools.values())
        self._pools.clear()
        for pool in pools:
            pool.close()

    # --- the request ----------------------------------------------------------------------

    def _pool_for(self, upstream: Upstream) -> WorkerPool:
        pool = self._pools.get(upstream.worker_id)
        if pool is not None and pool.url == upstream.url:
            return pool  # hot path: one dict lookup and one string compare
        if self._closed:
            raise UpstreamFailure("error", "the router is shutting down", request_sent=False)
        if pool is not None:
            pool.close()  # the worker came back at another address
        try:
            address = parse_worker_address(upstream.url)
        except ValueError as exc:
            detail = f"unsupported worker address {upstream.url!r}: {exc}"
            raise UpstreamFailure("error", detail, request_sent=False) from exc
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        share = self._buffering.paced_share
        pool = WorkerPool(upstream.url, address, self.pool_size, self._loop, share)
        self._pools[upstream.worker_id] = pool
        return pool

    async def _gather_body(self, exchange: Exchange) -> bytes | None:
        """The whole body, read before any worker connection is taken, when it fits the
        body buffer and the budget: a slow upload then holds only its own bytes, and
        its silence is the body timeout's (408). None when it streams instead: too large
        (by its Content-Length, or chunked and grown past the buffer), or the budget is
        spent before it is all here; the part here goes first. Budget is reserved as the
        bytes arrive (at most `_BODY_STEP` ahead of them), never for bytes only announced,
        and given back when the body streams. Raises UpstreamFailure (nothing was sent)."""
        request = exchange.request
        stream = request.body
        assert stream is not None
        bound = self._buffering.body_bytes
        length = request.content_length
        if length is not None and length > bound:
            return None
        most = bound if length is None else length
        held = 0
        while True:
            arrived = stream.received
            if arrived > held:
                more = min(arrived - held + _BODY_STEP, most - held)
                if arrived > most or not self.budget.reserve(more):
                    self._give_back(exchange)  # it streams: what is here goes out first
                    return None
                held += more
                exchange.reserved += more
            if stream.complete:
                break
            try:
                # Returns at the end of the body, or once more than `held` is here.
                await stream.gather(held)
            except BodyBroken as broken:
                raise body_failure(broken, request_sent=False) from None
        body = request.read_now()
        limit = self.max_body_bytes
        if limit is not None and len(body) > limit:  # chunked: no length was announced
            raise UpstreamFailure("too_large", "the request body is over the limit", False)
        return body

    def _give_back(self, exchange: Exchange) -> None:
        """The budget `exchange` reserved goes back (its bytes stream, or are gone)."""
        reserved = exchange.reserved
        if reserved:
            exchange.reserved = 0
            self.budget.give_back(reserved)

    def _let_go(self, exchange: Exchange) -> None:
        """The forward is over: its connection dropped unless the relay gave it back, its
        paced place and its buffer bytes returned."""
        exchange.settle(clean=False)  # a no-op once the relay settled it
        if exchange.reserved:
            self._give_back(exchange)

    async def _send(self, exchange: Exchange, first: bytes, whole: bool) -> None:
        """Writes the request (`first` and `whole`: see `router.relay.request.outgoing`) on a
        pooled or new connection; returns once the reply head is in. Raises UpstreamFailure."""
        loop = self._loop
        assert loop is not None
        timeouts = self._timeouts
        pool = exchange.pool
        if not whole:
            # A body that streams holds its connection at the client's pace: only the
            # pool's share for that, so the rest stays for requests whose bodies are in.
            if not pool.take_paced():
                detail = f"its {pool.paced_limit} places for streamed uploads are taken"
                raise UpstreamFailure("busy", detail, request_sent=False)
            exchange.paced = True
        try:
            conn = await pool.acquire(loop.time() + timeouts.connect_s)
        except (OSError, PoolClosed, PoolBusy) as exc:
            raise connect_failure(exc, timeouts, request_sent=False) from exc
        exchange.conn = conn
        # A client that leaves while the worker works wakes the wait for its reply at once.
        exchange.request.on_client_lost = exchange
        if not whole:
            limit = self.max_body_bytes
            start_upload(exchange, conn, first, loop, timeouts.first_byte_s, limit)
            failure = await self._reply_head(exchange, conn)
        else:
            self._write_request(exchange, conn, first)  # one write: one recv for the worker
            failure = await self._reply_head_or_retry(exchange, first)
        if failure is not None:
            raise failure

    def _write_request(self, exchange: Exchange, conn: WorkerConnection, message: bytes) -> None:
        """Writes a whole request; the wait for its reply head starts now."""
        conn.write(message)
        # The reply is readied after the write, not before: no reply can be read until
        # this returns to the loop, and a write calls back only pause_writing or
        # resume_writing, which leave the reply alone. The worker then has the request
        # sooner, by ReplyParser.begin's cost.
        conn.expect_reply(head_request=exchange.request.method == "HEAD")
        loop = self._loop
        assert loop is not None
        exchange.deadline = loop.time() + self._timeouts.first_byte_s

    async def _reply_head_or_retry(
        self, exchange: Exchange, message: bytes
    ) -> UpstreamFailure | None:
        """Waits for the reply head to the whole request `message`, already written on the
        exchange's connection; once more on a new connection when that one was stale."""
        conn = exchange.conn
        assert conn is not None
        failure = await self._reply_head(exchange, conn)
        if failure is None or not stale(conn, exchange.request.method):
            return failure
        # The worker closed this kept-alive connection as the request went in: nothing
        # came back, so a request that may be repeated goes once more, on a connection
        # opened for it.
        loop = self._loop
        assert loop is not None
        timeouts = self._timeouts
        try:
            conn = await exchange.pool.reopen(conn, loop.time() + timeouts.connect_s)
        except (OSError, PoolClosed) as exc:
            # Not sent, by the rule that allowed this retry: it may go again elsewhere
            # (a worker or a peer router killed under it is then answered as one that
            # cannot be reached, not as one that failed mid-request).
            exchange.conn = None
            raise connect_failure(exc, timeouts, request_sent=False) from exc
        exchange.conn = conn  # a client leaving now wakes this one's wait (client_lost)
        self._write_request(exchange, conn, message)
        return await self._reply_head(exchange, conn)

    async def _reply_head(
        self, exchange: Exchange, conn: WorkerConnection
    ) -> UpstreamFailure | None:
        """Waits for the reply head, until `exchange.deadline` (set when the request, or
        its last uploaded chunk, was written); None once it is in, else the failure."""
        reply = conn.reply
        first_byte_s = self._timeouts.first_byte_s
        while not reply.head_done:
            if exchange.too_large:
                return UpstreamFailure("too_large", "the request body is over the limit")
            if exchange.body_broke is not None:
                return body_failure(exchange.body_broke, request_sent=True)
            if exchange.request.client.client_gone:
                return UpstreamFailure("client_left", CLIENT_GONE)
            if reply.broken is not None:
                return UpstreamFailure("error", reply.broken)
            deadline = exchange.deadline
            if await conn.wait(deadline) == TIMED_OUT and exchange.deadline == deadline:
                if exchange.body_failed():
                    # The body failed as this deadline passed (the client's body clock
                    # ran out with it, and the upload ran first): the client's failure,
                    # answered at the top of the loop, never the worker's timeout.
                    continue
                if exchange.awaiting_client:
                    # The client is still sending its body (trailers, say, that move no
                    # chunk): its body clock answers its silence with 408. The worker's
                    # time starts again from the client's next chunk or its end.
                    exchange.deadline = asyncio.get_running_loop().time() + first_byte_s
                    continue
                return UpstreamFailure("timeout", f"no reply within {first_byte_s:g} s")
        return None

    # --- the reply --------------------------------------------------------------------------

    async def _relay(
        self, exchange: Exchange, public_base: str | None, observer: ReplyObserver | None
    ) -> int:
        conn = exchange.conn
        assert conn is not None
        reply = conn.reply
        request = exchange.request
        if observer is not None:
            await self._observe(conn, observer)
            write = observer.directory_write
            if write is not None and not await write:
                # The session this reply created routes nowhere: the client must not
                # hear of it. The worker's connection is dropped (the finally's settle).
                raise UpstreamFailure("directory", _NOT_WRITTEN, request_sent=True)
            if request.client.client_gone:
                # Left while the body was read for the observer: the worker's connection
                # is dropped now (the finally's settle), not read to its end.
                raise UpstreamFailure("client_left", CLIENT_GONE, request_sent=True)
        status, reason = reply.status, reply.raw_reason
        length = reply.content_length
        if reply.complete or (length is not None and length <= WHOLE_BODY_MAX):
            why = await self._whole_reply(conn, request)
            if why is None:
                return send_whole(exchange, public_base)
            headers = client_headers(exchange, public_base)
            body = conn.take_body()
            exchange.settle(clean=False)
            send_cut(request, (status, reason, headers), body, why, self._timeouts.stream_idle_s)
            return status
        how = await self._buffer_or_pace(exchange, length)
        if how is None:
            status = send_whole(exchange, public_base)  # its connection is back in the pool
            await _client_took_it(request)  # its bytes stay reserved until then
            return status
        if isinstance(how, str):  # why it broke off
            headers = client_headers(exchange, public_base)
            body = conn.take_body()
            exchange.settle(clean=False)
            send_cut(request, (status, reason, headers), body, how, self._timeouts.stream_idle_s)
            return status
        # What was read into memory goes out with the head: the budget is the streams' no
        # more (a paced reply is bounded by the share, one past it by OVER_SHARE_SEND_S).
        self._give_back(exchange)
        over_share = how is Pacing.OVER_SHARE
        send_s = self.over_share_send_s if over_share else None
        headers = client_headers(exchange, public_base)
        idle_s = self._timeouts.stream_idle_s
        why_cut = await stream_reply(request, (status, reason, headers), conn, idle_s, send_s)
        if why_cut is None:
            exchange.settle(clean=True)
            request.client.reply_end()
        else:
            exchange.settle(clean=False)
            if over_share and why_cut != CLIENT_GONE:
                self.paced_over_share_cut += 1
            log.info("reply to %s %s aborted: %s", request.method, request.path, why_cut)
            request.client.reply_abort(idle_s)
        return status

    async def _buffer_or_pace(self, exchange: Exchange, length: int | None) -> str | Pacing | None:
        """How a reply too large to go in one write is relayed: None once it is read
        whole into memory, a `Pacing` to relay it at the client's pace, else why it
        broke off.

        An event stream streams, and takes no paced place (it is per session and must
        flush at once). A reply whose Content-Length fits the reply buffer is read whole
        as far as the budget goes. Any other reply (larger, or of unknown length) takes
        one of the pool's paced places; none free, it is read whole all the same, what
        its framing, as far as the budget goes. Past the budget too, the exchange waits
        up to `timeouts.connect_s` for a paced place, reading no more of the reply; none
        freed, it streams past the share (`paced_over_share`), and its client must take
        what is written within `OVER_SHARE_SEND_S` or the reply is cut: a reply the
        worker made reaches a client that reads, and a client that reads nothing holds a
        connection past the share for seconds, not for as long as it likes."""
        conn = exchange.conn
        assert conn is not None
        if _is_event_stream(conn.reply.raw_headers):
            return Pacing.STREAMS
        bound = self._buffering.reply_bytes
        if length is not None and length <= bound:
            why = await self._read_whole(exchange, length, length)
            if why is not Pacing.STREAMS:
                return why
        if exchange.paced or exchange.pool.take_paced():
            exchange.paced = True
            return Pacing.STREAMS
        why = await self._read_whole(exchange, None, max(bound, _READ_STEP))
        if why is not Pacing.STREAMS:
            return why
        loop = self._loop
        assert loop is not None
        placed = await exchange.pool.wait_paced(loop.time() + self._timeouts.connect_s)
        if placed:
            exchange.paced = True
        if exchange.request.client.client_gone:
            raise UpstreamFailure("client_left", CLIENT_GONE, request_sent=True)
        if placed:
            return Pacing.STREAMS
        self.paced_over_share += 1
        return Pacing.OVER_SHARE

    async def _read_whole(
        self, exchange: Exchange, most: int | None, step: int
    ) -> str | Pacing | None:
        """Reads the reply to its end into memory, reserving budget `step` bytes at a
        time (never past its Content-Length) and reading no further than reserved: None
        at its end, `Pacing.STREAMS` once it passes `most` bytes (None: no bound but the
        budget) or the budget is spent, else why it broke off. Raises UpstreamFailure
        (client_left) when the client leaves."""
        conn = exchange.conn
        assert conn is not None
        reply = conn.reply
        request = exchange.request
        idle_s = self._timeouts.stream_idle_s
        loop = self._loop
        assert loop is not None
        length = reply.content_length
        held = exchange.reserved  # reply bytes reserved by an earlier read (the body's went back)
        try:
            while not reply.complete:
                if reply.broken is not None:
                    return f"the worker's reply broke off ({reply.broken})"
                if request.client.client_gone:
                    raise UpstreamFailure("client_left", CLIENT_GONE, request_sent=True)
                if most is not None and reply.buffered > most:
                    return Pacing.STREAMS
                if reply.buffered >= held:
                    # Past what is held by a step: reading (paused at `held`) goes on.
                    more = reply.buffered - held + step
                    if length is not None:
                        more = min(more, length - held)  # no budget for bytes never sent
                    if not self.budget.reserve(more):
                        return Pacing.STREAMS
                    held += more
                    exchange.reserved += more
                    conn.read_up_to(held)
                if await conn.wait(loop.time() + idle_s) == TIMED_OUT:
                    return f"no reply data for {idle_s:g} s"
            return None
        finally:
            conn.read_up_to(None)

    async def _whole_reply(self, conn: WorkerConnection, request: PublicRequest) -> str | None:
        """Reads a reply known to be small to its end; None then, else why it stopped.
        Raises UpstreamFailure (client_left) when the client leaves meanwhile: nothing
        of the reply went out, and the worker's connection is dropped, not read on."""
        reply = conn.reply
        idle_s = self._timeouts.stream_idle_s
        loop = self._loop
        assert loop is not None
        while not reply.complete:
            if reply.broken is not None:
                return f"the worker's reply broke off ({reply.broken})"
            if request.client.client_gone:
                raise UpstreamFailure("client_left", CLIENT_GONE, request_sent=True)
            if await conn.wait(loop.time() + idle_s) == TIMED_OUT:
                return f"no reply data for {idle_s:g} s"
        return None

    async def _observe(self, conn: WorkerConnection, observer: ReplyObserver) -> None:
        """Shows the head to `observer`, then the body if it is small and it asks; the
        bytes read for it stay in the reply, to be relayed first."""
        reply = conn.reply
        headers = CIMultiDict(reply.headers)
        wanted = observer.head(reply.status, headers, headers.getall("Set-Cookie", []))
        length = reply.content_length
        if wanted <= 0 or (length is not None and length > wanted):
            return
        loop = self._loop
        assert loop is not None
        deadline = loop.time() + self._timeouts.stream_idle_s
        while not reply.complete and reply.broken is None and reply.buffered <= wanted:
            if await conn.wait(deadline) != WOKE:
                # Timed out: what was read is relayed, and the relay meets the same stall.
                # Interrupted: the client left (the caller looks).
                return
        if reply.complete and reply.buffered <= wanted:
            observer.body(reply.peek_body())


class Pacing(enum.Enum):
    """How a reply is relayed at its client's pace (`_buffer_or_pace`); a reason for a
    broken reply is a `str`, never one of these."""

    STREAMS = "in a paced place (or an event stream, which takes none)"
    OVER_SHARE = "past the pool's share for paced replies: bounded by OVER_SHARE_SEND_S"


# A reply streamed past the pool's share is cut when its client takes nothing written to
# it for this long (nginx's send_timeout, shortened): a client reading a few KiB a
# second keeps it; one that reads nothing holds a connection outside the share for
# seconds, not for the edge's idle_timeout_s.
OVER_SHARE_SEND_S: Final = 5.0
_NOT_WRITTEN: Final = "the claims directory did not take the session this reply created"
_EVENT_STREAM: Final = b"text/event-stream"
# A body buffered before its worker connection is taken reserves budget this much ahead
# of the bytes here: about one reservation a read, and never more held than arrived but
# one step (a head that announces 1 MiB and sends nothing holds nothing).
_BODY_STEP: Final = 64 * 1024
# A reply read whole past the reply buffer reserves budget this much at a time.
_READ_STEP: Final = 1024 * 1024


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    """True for a reply whose Content-Type is an event stream (SSE)."""
    for name, value in headers:
        if len(name) == 12 and name.lower() == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == _EVENT_STREAM
    return False


async def _client_took_it(request: PublicRequest) -> None:
    """Returns once the client has taken what was written to it (or left)."""
    with contextlib.suppress(ConnectionError):
        await request.client.drain()
