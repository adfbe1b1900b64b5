"""The public handler: read the session, ask the core, forward or answer.

This module owns the routing flow of one request: the early refusals, the session read
from its head, path or body, the core's decision, the forward (on the relay's lane when
it can go at once, else as a coroutine), the retries of a sessionless request, and the
metrics and access log of a request that is done. It never writes an answer itself
(`router.app.exchange` does, and picks the answer a failed forward gets, but for the
core's answer when a sessionless retry finds no worker), and never builds where a
forward goes (`router.app.destination`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Final

from router.app.destination import destination, owner_worker_destination, public_base
from router.app.exchange import (
    BODY_OVER_LIMIT,
    MAX_LOGGED_PATH,
    Exchange,
    ExchangeOwner,
    failure_answer,
)
from router.core import Answer, Claim, ClaimState, Forward, RouterCore, Worker
from router.directory import OwnerWorker, RequestMeaning
from router.directory.cache import HELD_MARGIN_S
from router.edge import BodyBroken, PublicRequest, framing_problem
from router.edge.head_text import forwarded_host_text
from router.fleet import (
    PEER_HEADER,
    FleetLink,
    Lookup,
    answer_for,
    lease_lapsed,
    not_owner,
    owner_restarted,
    owner_unreachable,
    peer_refused,
    sign,
    verify,
)
from router.metrics import RouterMetrics
from router.protocol import is_ip
from router.relay import Forwarder, LaneDone, Upstream, UpstreamFailure, as_value
from router.sessions import (
    LearningPlan,
    ReplyLearner,
    SessionReader,
    SessionRef,
    plan_learning,
)

log = logging.getLogger("episode_router.public")
access_log = logging.getLogger("episode_router.access")

HELD: Final = ClaimState.HELD
# A router's own 421 answer fits in this (a worker's larger 421 is relayed as it is).
NOT_OWNER_BODY_BYTES: Final = 1024
# Peer addresses whose upstreams are kept: far more than a fleet has routers.
MAX_KEPT_PEERS: Final = 1024
# What one peer hop came to (PublicHandler._hop).
_RELAYED: Final = "relayed"
_NOT_OWNER: Final = "not_owner"
_UNREACHED: Final = "unreached"
# A straight forward to another router's worker needs that router's lease to run at
# least this much longer (the lookup cache's margin): the request reaches the worker
# well before the lease lapses, after which another router may answer the key 410.
STRAIGHT_LEASE_LEFT_MS: Final = round(HELD_MARGIN_S * 1000)
MAX_SESSIONLESS_TRIES: Final = 3  # a sessionless request nothing of which reached a worker
# A Final name: the compiled build keeps it in a C variable, where an imported name is
# looked up in the module's dict at each call (three times a request).
_perf_counter: Final = time.perf_counter


class OnTheLane:
    """What `PublicHandler._route` returns for a request the relay's lane carries on:
    its callback finishes it (`PublicHandler.hop_done`); or a first ask's lookup
    (`FirstAsk`)."""

    __slots__ = ()


_ON_THE_LANE: Final = OnTheLane()


class FirstAsk:
    """The callback a first ask's lookup answers (`FleetLink.lookup_then`): the request
    is settled from there (`PublicHandler.first_ask_answered`). A failure there fails
    the request's connection as a failed handler task would, not the batch's other
    callers."""

    __slots__ = ("_exchange", "_handler", "_key", "_kind")

    def __init__(self, handler: PublicHandler, exchange: Exchange, kind: str, key: str) -> None:
        self._handler = handler
        self._exchange = exchange
        self._kind = kind
        self._key = key

    def __call__(self, found: Lookup) -> None:
        try:
            self._handler.first_ask_answered(self._exchange, self._kind, self._key, found)
        except Exception as error:
            request = self._exchange.request
            request.client.carry_on(request, _raise(error))


async def _raise(error: Exception) -> None:
    raise error


class PublicHandler(ExchangeOwner):
    """Routes one request at a time; holds no per-request state of its own."""

    def __init__(
        self,
        core: RouterCore,
        sessions: SessionReader,
        forwarder: Forwarder,
        *,
        check_worker: Callable[[Worker], Awaitable[bool]],
        max_body_bytes: int | None = None,
        metrics: RouterMetrics | None = None,
        access_log: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self.sessions = sessions
        self.forwarder = forwarder
        # Probes a worker whose forward failed and retires it if nothing listens.
        self._check_worker = check_worker
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.access_log = access_log  # one line per request (log.access)
        self._clock = clock
        self._wall_clock = wall_clock
        self.shutting_down = False
        # Several routers (design §10): keys this router's table does not know are looked
        # up in the directory, and those a peer holds forwarded there (`fleet`); on the
        # peer listener's handler (`peer_side`), every request must carry a valid hop,
        # and is answered from this router's own table only.
        self.fleet: FleetLink | None = None
        self.peer_secret = b""
        self.peer_side = False
        self._peer_upstreams: dict[str, Upstream] = {}

    def handle(self, request: PublicRequest) -> Coroutine[Any, Any, None] | None:
        """Answers or forwards `request`; its reply goes out through its connection.

        What can be done at once is (the edge's handler contract, `router.edge.server.Handler`):
        an answer of the router's own, and a forward the relay can start without a task
        (`Forwarder.start`), after which the relay's callback finishes the request, and
        a first ask of the directory (`FirstAsk`: its reply's callback goes on). None
        then, and `request.client.finished()` is called once the reply is out. Anything
        that must wait (a body to read for its session, a new worker connection, a
        reply to stream, a failure to look into) is returned as a coroutine to run.
        """
        exchange = Exchange(self, request, _perf_counter())
        refusal = self._refuse_early(request)
        if refusal is None:
            reader = self.sessions
            if reader.routes:
                exchange.route_path = reader.route_path(request.path)
                if reader.has_seeds:
                    exchange.seeding = reader.seeding(request.method, exchange.route_path)
            found = reader.read_head(request, self._wall_clock(), exchange.seeding)
            if (
                reader.reads_bodies
                and (found is None or reader.wants_body(request.method, exchange.route_path))
                and _small_json_body(request, reader)
            ):
                return self._session_from_body(exchange, found)
            decision = self._route(exchange, found, lane=True)
            if decision is not None:
                if isinstance(decision, OnTheLane):
                    return None  # a peer hop on the relay's lane: hop_done finishes it
                if not isinstance(decision, Forward):
                    return decision  # a directory lookup first (design §10)
                return self._forward_now(exchange, decision)
        else:
            self._answer(exchange, refusal)
        request.client.finished(request)
        return None

    async def _session_from_body(
        self, exchange: Exchange, found: SessionRef | Answer | None
    ) -> None:
        """Reads the body, for the session it names when the head named none (`found`),
        or for what a body kind's seed or close route learns from it."""
        request = exchange.request
        _continue_if_expected(request)  # the session is in the body: let it come
        try:
            exchange.body = await request.read()
        except BodyBroken as broken:
            exchange.body_broke(broken)
            self._finish(exchange)
            return
        if found is None:
            found = self.sessions.read_body(exchange.body, exchange.seeding)
        decision = self._route(exchange, found, lane=False)
        if isinstance(decision, Forward):
            await self._forward_and_finish(exchange, decision)
        elif decision is not None and not isinstance(decision, OnTheLane):
            await decision

    def _route(
        self, exchange: Exchange, found: SessionRef | Answer | None, *, lane: bool
    ) -> Forward | Coroutine[Any, Any, None] | OnTheLane | None:
        """Where the request goes, from the session read so far; None when the router
        answered it itself (the answer is out and counted); a coroutine that routes it
        once the directory answered, for a key this router's table does not know;
        `_ON_THE_LANE` for a hop to its owner the relay's lane took, or for a first ask
        its lookup's callback settles (when `lane`: the caller is not a coroutine that
        would finish the request on its return)."""
        if found is None and self.sessions.reads_paths:
            found = self.sessions.read_path(exchange.route_path, exchange.seeding)
        if isinstance(found, Answer):
            # A session source refused (a bad token, an ambiguous header): counted and
            # logged under its kind, its decision timed like any other.
            exchange.kind = found.kind
            if self.metrics is not None:
                exchange.decided = _perf_counter()
            self._answer(exchange, found)
            return None
        exchange.found = found
        # Not a conditional tuple unpacked: the compiled build iterates that one as an
        # object.
        kind: str | None = None
        key: str | None = None
        if found is not None:
            kind = found.kind
            key = found.key
            if found.one_line is not None:
                header = self.sessions.by_name[kind].header
                if header is not None:
                    exchange.request.keep_one_header(header, found.one_line)
        exchange.kind = kind
        fleet = self.fleet
        if fleet is not None:
            if self.peer_side:
                refusal = self._peer_refusal(exchange.request, kind, key)
                if refusal is not None:
                    self._answer(exchange, refusal)
                    return None
            if kind is not None and key is not None:
                claim = self.core.claims.lookup(kind, key)
                if claim is None and not self.peer_side:
                    found_there = fleet.cached(kind, key)
                    if found_there is None:
                        # A first ask: the lookup's reply settles it from its own loop
                        # callback (FirstAsk), no task; a caller that is a coroutine
                        # awaits it instead.
                        if lane and fleet.lookup_then(
                            kind, key, FirstAsk(self, exchange, kind, key)
                        ):
                            return _ON_THE_LANE
                        return self._look_up_and_route(exchange, kind, key)
                    # The lookup cache's answer: acted on at once, no task for it, and a
                    # hop to its owner on the relay's lane when it can go at once.
                    if lane and found_there.meaning is RequestMeaning.PEER:
                        worker = self._straight_to(exchange, kind, found_there)
                        if worker is not None:
                            return self._straight_from_the_cache(
                                exchange, kind, key, found_there, worker
                            )
                        return self._hop_from_the_cache(exchange, kind, key, found_there)
                    return self._settle(exchange, kind, key, found_there, None)
                if claim is not None and self._lease_lapsed(exchange, claim, key):
                    return None
        return self._decide(exchange, kind, key)

    def _lease_lapsed(self, exchange: Exchange, claim: Claim, key: str) -> bool:
        """Whether `claim` is held here while this router's lease may have lapsed: then
        answered 503 (an ended or exited claim is 410 for good, lease or not). Checked as
        the request is served, not as it was accepted: a request that waited in a paused
        router's backlog meets the lapse too."""
        fleet = self.fleet
        assert fleet is not None
        if claim.state is HELD and not fleet.serving(self._clock()):
            self._answer(exchange, lease_lapsed(key))
            return True
        return False

    def _decide(self, exchange: Exchange, kind: str | None, key: str | None) -> Forward | None:
        """The local table's decision for the session read; None when it is an answer of
        the router's own (the answer is out and counted)."""
        if kind is not None and key is not None and self.sessions.learns:
            decision = self._route_on(exchange, kind, key)
        else:
            decision = self.core.route(kind, key, self._clock())
        if self.metrics is not None:
            # Observed when the request ends or its forward coroutine begins
            # (_decision_observed), not here: the histogram is then off the path to the
            # worker's write.
            exchange.decided = _perf_counter()
        if isinstance(decision, Answer):
            self._answer(exchange, decision)
            return None
        return decision

    def _peer_refusal(
        self, request: PublicRequest, kind: str | None, key: str | None
    ) -> Answer | None:
        """Why a request on the peer listener is refused: no valid hop for what this
        router read of it (403), or a hop meant for another incarnation (421)."""
        fleet = self.fleet
        assert fleet is not None
        values = request.getall(PEER_HEADER, [])
        session = (kind, key) if kind is not None and key is not None else None
        hop = verify(
            self.peer_secret,
            values[0] if len(values) == 1 else None,
            request.method,
            request.target,
            session,
            int(self._wall_clock() * 1000),
        )
        if isinstance(hop, str):
            fleet.counts.refused_hop("signature")
            return peer_refused(hop, key)
        if hop.receiver != fleet.incarnation:
            fleet.counts.refused_hop("not_owner")
            return not_owner(key)
        # The client is the one the sending router saw (it set X-Forwarded-For to it,
        # dropping any the client sent), not the sending router: the worker is told so.
        forwarded_for = request.getall("X-Forwarded-For", [])
        if len(forwarded_for) == 1 and is_ip(forwarded_for[0]):
            request.remote = forwarded_for[0]
        # So is the Host the client asked for (X-Forwarded-Host, the sending router's
        # relay put it there), not this peer listener's: the worker's X-Forwarded-Host
        # and the origin a Location is rewritten to are the client's.
        forwarded_host = request.getall("X-Forwarded-Host", [])
        if len(forwarded_host) == 1:
            host = forwarded_host_text(forwarded_host[0].encode("latin-1", "replace"))
            if host:
                request.host = host
                request.authority = host
        return None

    async def _look_up_and_route(self, exchange: Exchange, kind: str, key: str) -> None:
        """A key this router's table does not know, and the lookup cache neither: what
        the directory says of it decides (`_settle`)."""
        fleet = self.fleet
        assert fleet is not None
        found = await fleet.lookup(kind, key)
        # Read again: the key may have been claimed here while it was looked up.
        step = self._settle(exchange, kind, key, found, self.core.claims.lookup(kind, key))
        if isinstance(step, Forward):
            await self._forward_and_finish(exchange, step)
        elif step is not None:
            await step

    def first_ask_answered(self, exchange: Exchange, kind: str, key: str, found: Lookup) -> None:
        """A first ask's lookup answered (`FirstAsk`, from the reply's loop callback): on
        as `_look_up_and_route` goes, and as `handle` goes with what it settles on (a
        forward on the relay's lane when it can start at once, else a task)."""
        request = exchange.request
        step = self._settle(exchange, kind, key, found, self.core.claims.lookup(kind, key))
        if isinstance(step, Forward):
            forwarding = self._forward_now(exchange, step)
            if forwarding is not None:
                request.client.carry_on(request, forwarding)
        elif step is not None:
            request.client.carry_on(request, step)
        else:
            request.client.finished(request)

    def _forward_now(
        self, exchange: Exchange, decision: Forward
    ) -> Coroutine[Any, Any, None] | None:
        """Forwards a request `handle` or a first ask's answer decided on: None when the
        relay's lane took it (`lane_done` finishes it), else the coroutine that forwards
        it. A reply a learner must see goes the coroutine path (`Forwarder.forward`)."""
        observer = self._learner(exchange, decision.worker)
        if observer is None and self._start_forward(exchange, decision):
            return None
        # Counted in flight now, with the decision: the next request the loop routes
        # before this coroutine runs must see it (workers.pick).
        first = self._try_worker(exchange, decision, observer)
        return self._forward_and_finish(exchange, decision, first)

    def _settle(
        self, exchange: Exchange, kind: str, key: str, found: Lookup, claim: Claim | None
    ) -> Forward | Coroutine[Any, Any, None] | None:
        """What a lookup's answer does with a request for a key this router's table did
        not know (design §10, the request path), `claim` its record here now: its owner's
        peer listener (a coroutine), a 410 or a 503 (None: answered), or this router's
        own decision (its own key, or nobody's in a settled fleet, or claimed here
        meanwhile)."""
        if claim is None:
            if found.meaning is RequestMeaning.PEER:
                if self._straight_to(exchange, kind, found) is not None:
                    return self._to_owner_worker(exchange, kind, key, found)
                return self._to_peer(exchange, kind, key, found)
            answer = answer_for(found.meaning, key, kind in self.core.settings.mcp_kinds)
            if answer is not None:
                if self.metrics is not None:
                    exchange.decided = _perf_counter()
                self._answer(exchange, answer)
                return None
        elif self._lease_lapsed(exchange, claim, key):
            return None
        return self._decide(exchange, kind, key)

    def _straight_to(self, exchange: Exchange, kind: str, found: Lookup) -> OwnerWorker | None:
        """The owner's worker a request may go to straight (shape B: its router shares
        this host and published it), or None: then through the owner's peer listener.
        Not a request whose reply or route the owner's table would learn from (a seed,
        a close, an MCP session's start or end): only the owner may. Not when the owner's
        lease may lapse before the request reaches the worker: the owner stops serving
        its keys then (a paused router), and another router may answer 410."""
        result = found.result
        worker = result.worker if result is not None else None
        if worker is None or result is None or result.lease_left_ms < STRAIGHT_LEASE_LEFT_MS:
            return None
        reader = self.sessions
        if reader.learns and (
            reader.route_of(kind, exchange.request.method, exchange.route_path) != "session"
            or self._learning_plan(exchange)
        ):
            return None
        return worker

    def _straight_from_the_cache(
        self, exchange: Exchange, kind: str, key: str, found: Lookup, worker: OwnerWorker
    ) -> OnTheLane | Coroutine[Any, Any, None]:
        """The cached answer's straight forward on the relay's lane (`Forwarder.start`)
        when it can go at once, as a local forward does; else as a coroutine."""
        upstream, extra = owner_worker_destination(worker)
        straight = StraightForward(self, exchange, kind, key, found)
        if self.forwarder.start(
            exchange.request,
            upstream,
            straight,
            extra_headers=extra,
            public_base=public_base(exchange.request.host),
            body=exchange.body,
        ):
            return _ON_THE_LANE
        return self._to_owner_worker(exchange, kind, key, found)

    def straight_done(
        self, straight: StraightForward, result: int | Coroutine[Any, Any, int]
    ) -> None:
        """The relay's callback for a straight forward on its lane: the reply went out
        (`result` is its status), or the rest of it is a coroutine to run."""
        exchange = straight.exchange
        request = exchange.request
        if isinstance(result, int):
            fleet = self.fleet
            assert fleet is not None
            fleet.counts.peer_forward("direct")
            exchange.status = result
            self._finish(exchange)
            request.client.finished(request)
            return
        request.client.carry_on(
            request,
            self._to_owner_worker(exchange, straight.kind, straight.key, straight.found, result),
        )

    async def _to_owner_worker(
        self,
        exchange: Exchange,
        kind: str,
        key: str,
        found: Lookup,
        started: Coroutine[Any, Any, int] | None = None,
    ) -> None:
        """The request straight to the worker that holds `key` (shape B), with its boot,
        from its start or from the rest of one its lane handed over (`started`):
        another process on that address refuses it (410). One nothing of which reached
        the worker (it exited, or its address is gone) goes through its owner's peer
        listener instead, whose table answers (410 for an exited worker); a failure
        after the request went out is answered as the owner would (502, 504), but a
        worker that closed (or reset) the connection unanswered as its owner retired or died
        (it stops its workers as it stops) gives the key's 410 (`_hop_failed`)."""
        fleet = self.fleet
        assert fleet is not None and found.result is not None
        worker = found.result.worker
        assert worker is not None
        self._decision_observed(exchange)
        request = exchange.request
        if started is None:
            _continue_if_expected(request)
            upstream, extra = owner_worker_destination(worker)
            started = self.forwarder.forward(
                request,
                upstream,
                extra_headers=extra,
                public_base=public_base(request.host),
                body=exchange.body,
            )
        try:
            try:
                exchange.status = await started
            except UpstreamFailure as raised:
                failure = as_value(raised)
                if exchange.failed_by_client(failure):
                    pass
                elif failure.kind == "busy":  # this router's pool to it is full: not blamed
                    exchange.answer(
                        Answer(
                            "worker_busy",
                            f"The worker's connections are all busy ({failure.detail}); try again.",
                            key,
                            retry_after_s=1.0,
                        )
                    )
                elif not failure.request_sent:
                    fleet.forget(kind, key)
                    await self._forward_to_peer(exchange, kind, key, found, None, None)
                else:
                    fleet.forget(kind, key)
                    exchange.answer(await self._hop_failed(kind, key, failure))
            else:
                fleet.counts.peer_forward("direct")
        except BodyBroken as broken:
            exchange.body_broke(broken)
        self._finish(exchange)

    def _hop_from_the_cache(
        self, exchange: Exchange, kind: str, key: str, found: Lookup
    ) -> OnTheLane | Coroutine[Any, Any, None]:
        """The hop to the router that holds `key` on the relay's lane (`Forwarder.start`),
        when it can go at once; its 421 goes the coroutine path, to be held back
        (`PeerHop`). When it cannot (nothing was sent), the hop as a coroutine, with the
        header signed once for both."""
        assert found.result is not None and found.result.peer
        header = self._hop_header(exchange, kind, key, found)
        hop = PeerHop(self, exchange, kind, key, found)
        if self.forwarder.start(
            exchange.request,
            self._peer_upstream(found.result.peer),
            hop,
            extra_headers={PEER_HEADER: header},
            public_base=None,
            body=exchange.body,
            observer=hop,
            observed_status=421,
        ):
            return _ON_THE_LANE
        return self._to_peer(exchange, kind, key, found, header=header)

    def hop_done(self, hop: PeerHop, result: int | Coroutine[Any, Any, int]) -> None:
        """The relay's callback for a hop on its lane (`PeerHop.lane_done`): the reply
        went out (`result` is its status), or the rest of the hop is a coroutine to run."""
        exchange = hop.exchange
        request = exchange.request
        if isinstance(result, int):
            fleet = self.fleet
            assert fleet is not None
            fleet.counts.peer_forward("forwarded")
            exchange.status = result
            self._finish(exchange)
            request.client.finished(request)
            return
        request.client.carry_on(
            request, self._to_peer(exchange, hop.kind, hop.key, hop.found, result)
        )

    async def _to_peer(
        self,
        exchange: Exchange,
        kind: str,
        key: str,
        found: Lookup,
        started: Coroutine[Any, Any, int] | None = None,
        header: str | None = None,
    ) -> None:
        """The hop to the router that holds `key` as a coroutine, from its start (its
        peer header, if signed already) or from the rest of one its lane handed over
        (`started`)."""
        self._decision_observed(exchange)
        try:
            await self._forward_to_peer(exchange, kind, key, found, started, header)
        except BodyBroken as broken:
            exchange.body_broke(broken)
        self._finish(exchange)

    async def _forward_to_peer(
        self,
        exchange: Exchange,
        kind: str,
        key: str,
        found: Lookup,
        started: Coroutine[Any, Any, int] | None,
        header: str | None,
    ) -> None:
        """The hop to the router that holds `key`. A peer that answers 421 `not_owner`
        (it is no longer the incarnation the lookup named) is never relayed, and the
        directory is asked once more, whether the answer came from the cache or from
        Redis just now: the owner may have retired between the lookup and the hop
        (SIGTERM's certificate comes first, then its peer listener answers 421), and
        the key be 410 already; when the directory still names a live owner, the
        client gets 503 `recovering` and its retry's lookup finds the key's new owner.
        A cached answer whose owner cannot be reached is asked again too (its owner
        may have stopped since). Only a request nothing of which went out is sent
        again, to the owner the directory names now."""
        fleet = self.fleet
        assert fleet is not None
        if started is None:
            hop = await self._hop(exchange, kind, key, found, header)
        else:
            assert found.result is not None and found.result.peer
            peer = self._peer_upstream(found.result.peer)
            hop = await self._hop_outcome(exchange, kind, key, peer, started)
        if hop == _NOT_OWNER or (hop == _UNREACHED and found.cached):
            fresh = await fleet.lookup(kind, key)  # the answer that named it was dropped
            if fresh.meaning is RequestMeaning.PEER:
                if hop == _UNREACHED:
                    hop = await self._hop(exchange, kind, key, fresh)
            else:
                answer = answer_for(fresh.meaning, key, kind in self.core.settings.mcp_kinds)
                if answer is not None:
                    exchange.answer(answer)
                    return
        if hop == _UNREACHED:
            fleet.counts.peer_forward("owner_unreachable")
            exchange.answer(owner_unreachable(key))
        elif hop == _NOT_OWNER:
            fleet.counts.peer_forward("not_owner")
            exchange.answer(owner_restarted(key))

    def _hop_header(self, exchange: Exchange, kind: str, key: str, found: Lookup) -> str:
        """The signed peer header of one hop to the incarnation `found` names."""
        fleet = self.fleet
        assert fleet is not None
        request = exchange.request
        return sign(
            self.peer_secret,
            request.method,
            request.target,
            (kind, key),
            fleet.incarnation,
            found.receiver,
            int(self._wall_clock() * 1000),
        )

    async def _hop(
        self, exchange: Exchange, kind: str, key: str, found: Lookup, header: str | None = None
    ) -> str:
        """One hop to the router that holds `key`, signed (`header`, when it was already),
        as a coroutine: what it came to (`_hop_outcome`)."""
        assert found.result is not None and found.result.peer
        request = exchange.request
        if header is None:
            header = self._hop_header(exchange, kind, key, found)
        _continue_if_expected(request)
        hop = PeerHop(self, exchange, kind, key, found)
        peer = self._peer_upstream(found.result.peer)
        forward = self.forwarder.forward(
            request,
            peer,
            extra_headers={PEER_HEADER: header},
            public_base=None,
            body=exchange.body,
            observer=hop,
        )
        return await self._hop_outcome(exchange, kind, key, peer, forward)

    async def _hop_outcome(
        self,
        exchange: Exchange,
        kind: str,
        key: str,
        peer: Upstream,
        forward: Coroutine[Any, Any, int],
    ) -> str:
        """What one hop's `forward` came to: its answer relayed as it is (`_RELAYED`, a
        failure after the request went out included), but for its 421 `not_owner`
        (`_NOT_OWNER`, which its PeerHop held back) and a peer that could not be reached,
        nothing of the request sent (`_UNREACHED`): nothing relayed for those two, and
        the answer that named that peer dropped from the lookup cache."""
        fleet = self.fleet
        assert fleet is not None
        counts = fleet.counts
        try:
            exchange.status = await forward
        except UpstreamFailure as raised:
            failure = as_value(raised)
            if exchange.failed_by_client(failure):
                return _RELAYED
            fleet.forget(kind, key)  # the retry asks the directory again
            if failure.kind == "directory":  # its PeerHop held a 421 not_owner back
                return _NOT_OWNER
            if not failure.request_sent:
                return _UNREACHED
            exchange.answer(await self._hop_failed(kind, key, failure, peer))
            return _RELAYED
        counts.peer_forward("forwarded")
        return _RELAYED

    async def _hop_failed(
        self, kind: str, key: str, failure: UpstreamFailure, peer: Upstream | None = None
    ) -> Answer:
        """The answer to a hop (to the owner's `peer` listener, or straight to its
        worker) that failed after the request went out, counted: 502 or 504; or, when
        the far side's connection ended before its reply's head (closed before a byte
        of it, or reset), the key's 410 if the directory says the key is gone now, else
        503 `owner_unreachable` if the owner's peer listener no longer takes a
        connection.

        A router that stops writes its certificate, then closes its idle peer
        connections (and stops its workers); a hop decided from the lookup cache just
        before the invalidation came may be on its way on one of them, never read.
        Sent again it might run twice (the owner may instead have died mid-request),
        so it is not: but a key whose owner retired or died is 410 fleet-wide whatever
        became of the request, and that is the answer then. An owner killed as the hop
        reached it (its kernel closes or resets the connection) is not dead to the
        directory until its lease lapses: its listener refuses a new connection
        (nothing is sent on it), and the answer is the one any request gets while that
        lease runs, 503 then 410, not 502."""
        fleet = self.fleet
        assert fleet is not None
        if failure.ended_unanswered:
            meaning = (await fleet.lookup(kind, key)).meaning
            if meaning is RequestMeaning.WORKER_EXITED or meaning is RequestMeaning.EPISODE_ENDED:
                gone = answer_for(meaning, key, kind in self.core.settings.mcp_kinds)
                assert gone is not None
                fleet.counts.peer_forward("owner_gone")  # answered, not a failure
                return gone
            if peer is not None and not await self.forwarder.accepts_connections(peer):
                fleet.counts.peer_forward("owner_unreachable")
                return owner_unreachable(key)
        fleet.counts.peer_forward("failed")
        return owner_failed(failure, key)

    def _peer_upstream(self, address: str) -> Upstream:
        """The peer listener at `address` as the relay pools it (one pool per peer)."""
        upstream = self._peer_upstreams.get(address)
        if upstream is None:
            if len(self._peer_upstreams) >= MAX_KEPT_PEERS:
                self._peer_upstreams.clear()
            upstream = self._peer_upstreams[address] = Upstream(
                f"peer:{address}", f"http://{address}"
            )
        return upstream

    def _route_on(self, exchange: Exchange, kind: str, key: str) -> Forward | Answer:
        """A session's request where kinds have routes: a close route reaches a worker
        even for a session that ended or is unknown (its own contract answers), and a
        seed that names its own session goes to its holder, or is balanced (design §4)."""
        how = self.sessions.route_of(kind, exchange.request.method, exchange.route_path)
        now = self._clock()
        if how == "close":
            return self.core.route_close(kind, key, now)
        if how == "seed":
            return self.core.route_new(kind, key, now)
        return self.core.route(kind, key, now)

    def _answer(self, exchange: Exchange, answer: Answer) -> None:
        exchange.answer(answer)
        self._finish(exchange)

    async def _forward_and_finish(
        self,
        exchange: Exchange,
        decision: Forward,
        first: Awaitable[int | UpstreamFailure] | None = None,
    ) -> None:
        self._decision_observed(exchange)
        try:
            await self._forward(exchange, decision, first)
        except BodyBroken as broken:
            exchange.body_broke(broken)
        self._finish(exchange)

    def _finish(self, exchange: Exchange) -> None:
        """Counts and logs a request the router is done with."""
        elapsed = _perf_counter() - exchange.started
        metrics = self.metrics
        if metrics is not None:
            self._decision_observed(exchange)
            metrics.request_done(exchange.kind, exchange.outcome, exchange.status, elapsed)
        if self.access_log:
            request = exchange.request
            access_log.info(
                "request",
                extra={
                    "method": request.method,
                    "path": exchange.path[:MAX_LOGGED_PATH],
                    "status": exchange.status,
                    "outcome": exchange.outcome,
                    "kind": exchange.kind,
                    "duration_ms": round(elapsed * 1000, 3),
                    "client": request.remote,
                },
            )

    def refused_at_the_edge(self, answer: Answer) -> None:
        """A request head the edge refused (400, 414, 431) before this handler saw it:
        counted as the handler's own answers are (sessionless: no session was read)."""
        if self.metrics is not None:
            self.metrics.request_done(None, answer.code, answer.status, 0.0)

    def _decision_observed(self, exchange: Exchange) -> None:
        """Observes how long routing `exchange` took, once: when it ends (an answer, a
        reply relayed on the lane) or when its forward coroutine begins (a reply that
        may stream for long is counted at its start)."""
        decided = exchange.decided
        if decided and self.metrics is not None:
            exchange.decided = 0.0
            self.metrics.decision_seconds(decided - exchange.started)

    def _refuse_early(self, request: PublicRequest) -> Answer | None:
        if self.shutting_down:
            return Answer("shutting_down", "The router is shutting down.", retry_after_s=1.0)
        length = request.content_length
        problem = framing_problem(
            request.method,
            request.version,
            request.getall("Transfer-Encoding", []) if request.chunked else (),
            length,
            request.target,
        )
        if problem is not None:
            return Answer("bad_request", problem)
        if self.max_body_bytes is not None and length is not None and length > self.max_body_bytes:
            return BODY_OVER_LIMIT
        return None

    async def _forward(
        self,
        exchange: Exchange,
        decision: Forward,
        first: Awaitable[int | UpstreamFailure] | None = None,
    ) -> None:
        """Forwards, and on a failure answers it or tries another worker. `first`: the
        outcome of a first try already made (counted in flight with the decision, or a
        forward the lane handed over); None to make it here."""
        request = exchange.request
        sessionless = exchange.found is None
        _continue_if_expected(request)  # the worker never sees Expect: said here
        tried: set[str] = set()
        while True:
            worker = decision.worker
            tried.add(worker.id)
            outcome = await (
                first or self._try_worker(exchange, decision, self._learner(exchange, worker))
            )
            first = None
            if not isinstance(outcome, UpstreamFailure):
                exchange.status = outcome
                return
            if exchange.failed_by_client(outcome):
                return
            if outcome.kind == "directory":
                # The worker answered; the directory did not take the session its reply
                # created (design §10): 503, the worker not blamed, and no other worker
                # tried (this one ran the request).
                return exchange.answer(failure_answer(outcome, False, decision))
            if outcome.kind == "busy":
                # The router's own crowding (the worker's pool, or its share for streamed
                # exchanges, is full): the worker is not blamed, probed or counted failing.
                # Nothing reached it: a sessionless request may go to another worker.
                if sessionless and len(tried) < MAX_SESSIONLESS_TRIES:
                    retry = self.core.balance(None, frozenset(tried))
                    if isinstance(retry, Forward):
                        decision = retry
                        continue
                return exchange.answer(failure_answer(outcome, False, decision))
            if self.metrics is not None:
                self.metrics.upstream_failure(worker.id, outcome.kind)
            gone = outcome.kind != "timeout" and await self._check_worker(worker)
            # Nothing of it reached that worker (a refused or failed connect, a pool closed
            # under it as the worker was replaced, an address the relay cannot use):
            # another one may take a sessionless request. Not after a timeout: each try
            # would cost one.
            retriable = sessionless and outcome.kind != "timeout" and not outcome.request_sent
            if retriable and len(tried) < MAX_SESSIONLESS_TRIES:
                retry = self.core.balance(None, frozenset(tried))
                if isinstance(retry, Forward):
                    decision = retry
                    continue
                return exchange.answer(retry)
            return exchange.answer(failure_answer(outcome, gone, decision))

    def _try_worker(
        self, exchange: Exchange, decision: Forward, observer: ReplyLearner | None
    ) -> Coroutine[Any, Any, int | UpstreamFailure]:
        """One forward to the decision's worker, its reply shown to `observer`, counted in
        flight from now on."""
        worker = decision.worker
        worker.in_flight += 1
        upstream, extra, public_base = destination(decision, exchange.request.host)
        forward = self.forwarder.forward(
            exchange.request,
            upstream,
            extra_headers=extra,
            public_base=public_base,
            body=exchange.body,
            observer=observer,
        )
        return self._attempt(worker, forward)

    async def _attempt(
        self, worker: Worker, forward: Coroutine[Any, Any, int]
    ) -> int | UpstreamFailure:
        """The outcome of one forward to `worker`, counted in flight until it ends."""
        try:
            return await forward
        except UpstreamFailure as failure:
            return as_value(failure)  # its frames dropped: they hold the request
        finally:
            worker.in_flight -= 1

    def _start_forward(self, exchange: Exchange, decision: Forward) -> bool:
        """Starts the forward on the relay's lane (`Forwarder.start`) when it can go at
        once; False when it cannot."""
        worker = decision.worker
        worker.in_flight += 1
        upstream, extra, public_base = destination(decision, exchange.request.host)
        exchange.decision = decision
        started = self.forwarder.start(
            exchange.request,
            upstream,
            exchange,
            extra_headers=extra,
            public_base=public_base,
            body=exchange.body,
        )
        if not started:
            worker.in_flight -= 1
        return started

    def lane_done(self, exchange: Exchange, result: int | Coroutine[Any, Any, int]) -> None:
        """The relay's callback for a forward on its lane (`Exchange.lane_done`): the
        reply went out (`result` is its status), or the rest of the forward is a
        coroutine to run."""
        request = exchange.request
        decision = exchange.decision
        assert decision is not None
        if isinstance(result, int):
            decision.worker.in_flight -= 1
            exchange.status = result
            self._finish(exchange)
            request.client.finished(request)
            return
        first = self._attempt(decision.worker, result)
        request.client.carry_on(request, self._forward_and_finish(exchange, decision, first))

    def _learner(self, exchange: Exchange, worker: Worker) -> ReplyLearner | None:
        """A watcher for the reply when it may teach a claim (seed, close, MCP)."""
        plan = self._learning_plan(exchange)
        if not plan:
            return None
        return ReplyLearner(
            plan,
            self.core,
            worker,
            clock=self._clock,
            wall_clock=self._wall_clock,
            metrics=self.metrics,
            gate=self.fleet,
        )

    def _learning_plan(self, exchange: Exchange) -> LearningPlan | None:
        """What the reply to this request may teach (None: nothing, or no kind learns)."""
        reader = self.sessions
        if not reader.learns:
            return None
        request = exchange.request
        return plan_learning(
            reader,
            request.method,
            exchange.route_path,
            exchange.found,
            exchange.seeding,
            request,
            self._wall_clock(),
            exchange.body,
        )


class StraightForward(LaneDone):
    """A straight forward to another router's worker (shape B) on the relay's lane:
    its callback (`router.relay.LaneDone`)."""

    __slots__ = ("exchange", "found", "handler", "key", "kind")

    def __init__(
        self, handler: PublicHandler, exchange: Exchange, kind: str, key: str, found: Lookup
    ) -> None:
        self.handler = handler
        self.exchange = exchange
        self.kind = kind
        self.key = key
        self.found = found

    def lane_done(self, result: int | Coroutine[Any, Any, int]) -> None:
        self.handler.straight_done(self, result)


class PeerHop(LaneDone):
    """One hop to the router that holds a key: the relay's callback for it on the lane
    (`router.relay.LaneDone`), and its reply observer (`router.relay.ReplyObserver`),
    which holds a peer's own 421 `not_owner` back from the client, through the relay's
    hold on a reply the directory did not take (`directory_write` answering False)."""

    __slots__ = ("directory_write", "exchange", "found", "handler", "key", "kind")

    def __init__(
        self, handler: PublicHandler, exchange: Exchange, kind: str, key: str, found: Lookup
    ) -> None:
        self.handler = handler
        self.exchange = exchange
        self.kind = kind
        self.key = key
        self.found = found
        self.directory_write: Coroutine[Any, Any, bool] | None = None

    def lane_done(self, result: int | Coroutine[Any, Any, int]) -> None:
        self.handler.hop_done(self, result)

    def head(self, status: int, headers: Mapping[str, str], set_cookies: list[str]) -> int:
        return NOT_OWNER_BODY_BYTES if status == 421 else 0

    def body(self, data: bytes) -> None:
        if b'"error":"not_owner"' in data:  # the router's own answer, not a worker's 421
            self.directory_write = _held_back()


def owner_failed(failure: UpstreamFailure, key: str) -> Answer:
    """A hop to a key's owner (its router, or its worker straight) that failed after the
    request went out: 504 on a timeout, else 502."""
    if failure.kind == "timeout":
        return Answer("upstream_timeout", "The owner did not answer in time.", key)
    return Answer("upstream_error", f"The owner failed: {failure.detail}", key)


async def _held_back() -> bool:
    return False


def _continue_if_expected(request: PublicRequest) -> None:
    """`100 Continue` for a client that waits for it before it sends the body (once:
    the edge then clears `expect_continue`); without it, the client stalls until its
    own expect timeout."""
    if request.expect_continue and not request.body_complete:
        request.client.send_continue()


def _small_json_body(request: PublicRequest, reader: SessionReader) -> bool:
    """A body kind may look only at a JSON body whose length is known and small:
    anything else names no session (and is streamed, never buffered)."""
    length = request.content_length
    if length is None or length > reader.max_body_bytes:
        return False
    media = request.content_type
    return media == "application/json" or media.endswith("+json")
