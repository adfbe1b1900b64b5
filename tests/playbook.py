"""A scripted playbook for the router's pure state machine, in the style of mitmproxy's.

A test is a table of steps run against one `RouterCore` with a fake clock. A step
is an action (a control line on a named connection, a route query, a tick, or a
direct call into the core) and the outcome it must have. After every step the
playbook snapshots the whole state (every held claim and tombstone, every worker
with its lease, every `on_retire` call, the conflict counter) and asserts that it
equals the previous snapshot with exactly the step's declared changes applied: a
step that changes anything it does not declare fails, as h11's tests assert the
whole connection state after each event.

    Playbook(SETTINGS).run([
        (Send("a", hello(1, "w0")), ok(1, router=ROUTER_BOOT), {W("w0"): "live @a"}),
        (Send("a", {"op": "claim", "id": 2, "key": "ep1"}), ok(2), {C("ep1"): "held w0"}),
        At(3.0),
        (Route("ep1"), Fwd("w0", "ep1", "b0")),
    ])
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from router.control.session import ControlPolicy, ControlSession, Peer
from router.core.answers import Answer
from router.core.claims import Claim as ClaimRecord
from router.core.claims import ClaimState, ClaimTable
from router.core.machine import CoreSettings, Forward, RouterCore
from router.core.workers import Worker, WorkerOrigin
from router.protocol.control import decode_line, encode_line

ROUTER_BOOT = "router-boot-1"
OWN_UID = 1000
UNIX_PEER = Peer(uid=OWN_UID, tcp=False)

# -- what the snapshot is made of -------------------------------------------------

Entity: TypeAlias = tuple[str, ...]
Snapshot: TypeAlias = dict[Entity, object]
Changes: TypeAlias = Mapping[Entity, object]  # a value of None removes the entity

CONFLICTS: Entity = ("conflicts",)


def C(key: str, kind: str = "episode") -> Entity:
    """A claim or tombstone: its value reads "held w0", "ended w0", "exited w0"
    (with " learned" for learned claims)."""
    return ("claim", kind, key)


def W(worker: str) -> Entity:
    """A worker: "<state>[ <origin>][ draining][ g<generation>][ boot=<boot>][ @<conn>]":
    the origin unless it is `control`, the generation unless 0, the boot unless it is
    None or "b0" (what `hello` sends by default), the lease as its connection's name."""
    return ("worker", worker)


def R(worker: str) -> Entity:
    """How many times `on_retire` was called for this worker."""
    return ("retired", worker)


_CLAIM_WORDS = {ClaimState.HELD: "held", ClaimState.ENDED: "ended", ClaimState.EXITED: "exited"}


def claim_view(claim: ClaimRecord) -> str:
    learned = " learned" if claim.learned else ""
    return f"{_CLAIM_WORDS[claim.state]} {claim.worker}{learned}"


def claims_snapshot(table: ClaimTable, known_keys: Iterable[tuple[str, str]] = ()) -> Snapshot:
    """Every held claim and tombstone of `table`, after checking that its indexes agree:
    each record is what `lookup` finds, held claims are in their worker's index and
    tombstones are not, the counters (per worker, and per worker and kind) match, and no
    key in `known_keys` is found by `lookup` without being one of the records (a leak)."""
    snapshot: Snapshot = {}
    per_worker: Counter[str] = Counter()
    per_worker_kind: Counter[tuple[str, str]] = Counter()
    for claim in table.held():
        per_worker_kind[claim.worker, claim.kind] += 1
        assert claim.state is ClaimState.HELD, claim
        assert table.lookup(claim.kind, claim.key) is claim, claim
        assert claim in table.held_by(claim.worker), claim
        per_worker[claim.worker] += 1
        assert C(claim.key, claim.kind) not in snapshot, f"{claim} listed twice"
        snapshot[C(claim.key, claim.kind)] = claim_view(claim)
    tombstones = list(table.tombstones())
    for claim in tombstones:
        assert claim.state is not ClaimState.HELD, claim
        assert table.lookup(claim.kind, claim.key) is claim, f"{claim} buried but unreachable"
        assert claim not in table.held_by(claim.worker), claim
        assert C(claim.key, claim.kind) not in snapshot, f"{claim} listed twice"
        snapshot[C(claim.key, claim.kind)] = claim_view(claim)
    assert table.tombstone_count == len(tombstones)
    assert table.held_total == sum(per_worker.values())
    # The counts the metrics read, kept as claims change, match a count of the claims.
    assert table.held_counts_by_kind() == dict(per_worker_kind)
    for worker, count in per_worker.items():
        assert table.held_count(worker) == count == len(table.held_by(worker)), worker
    for kind, key in known_keys:
        found = table.lookup(kind, key)
        assert found is None or C(key, kind) in snapshot, f"{found} is in the table, unlisted"
    return snapshot


def apply_changes(snapshot: Snapshot, changes: Changes) -> Snapshot:
    after = dict(snapshot)
    for entity, value in changes.items():
        if value is None:
            after.pop(entity, None)
        else:
            after[entity] = value
    return after


def diff(expected: Snapshot, actual: Snapshot) -> str:
    lines = []
    for entity in sorted(set(expected) | set(actual)):
        want, got = expected.get(entity), actual.get(entity)
        if want != got:
            lines.append(f"  {entity}: expected {want!r}, got {got!r}")
    return "\n".join(lines)


# -- actions ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class At:
    """Move the fake clock to `t` (a bare step, no outcome)."""

    t: float


@dataclass(frozen=True, slots=True)
class Send:
    """One control line on connection `conn` (opened on first use): a dict is encoded
    as JSON, bytes are sent as they are. Outcome: the reply, as a dict."""

    conn: str
    message: Mapping[str, Any] | bytes


@dataclass(frozen=True, slots=True)
class Close:
    """Connection `conn` went away. Outcome: the id of the worker now lost, or None."""

    conn: str


@dataclass(frozen=True, slots=True)
class Route:
    """A request naming `key` of `kind` (None: no session). Outcome: `Fwd` or `Ans`."""

    key: str | None
    kind: str | None = "episode"


@dataclass(frozen=True, slots=True)
class Balance:
    """A sessionless retry that avoids `exclude`. Outcome: `Fwd` or `Ans`."""

    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Tick:
    """A periodic tick. `leased` names the workers whose leases are checked for
    silence; None means every worker with a lease, as the service passes."""

    leased: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Register:
    """`RouterCore.register`. Outcome: None (the snapshot shows the worker)."""

    worker: str
    url: str
    origin: WorkerOrigin = WorkerOrigin.CONTROL
    boot: str | None = None


@dataclass(frozen=True, slots=True)
class Expect:
    """`RouterCore.expect`. Outcome: None."""

    worker: str


@dataclass(frozen=True, slots=True)
class Claim:
    """`RouterCore.claim`. Outcome: the refusal or None."""

    worker: str
    key: str
    kind: str = "episode"


@dataclass(frozen=True, slots=True)
class Learn:
    """`ClaimTable.claim(..., learned=True)`: a claim learned from a seed route's reply.
    Outcome: the refusal or None."""

    worker: str
    key: str
    kind: str = "episode"


@dataclass(frozen=True, slots=True)
class Release:
    """`RouterCore.release`. Outcome: the bool it returns."""

    worker: str
    key: str
    kind: str = "episode"


@dataclass(frozen=True, slots=True)
class Sync:
    """`RouterCore.sync` with (kind, key) pairs. Outcome: the `SyncResult`."""

    worker: str
    claims: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Lose:
    """`RouterCore.lose`. Outcome: None."""

    worker: str


@dataclass(frozen=True, slots=True)
class Drain:
    """Set the worker's drain flag, as the admin API does. Outcome: None."""

    worker: str
    on: bool = True


@dataclass(frozen=True, slots=True)
class Retire:
    """`RouterCore.retire`. Outcome: how many claims became `worker_exited`."""

    worker: str


@dataclass(frozen=True, slots=True)
class Probe:
    """`RouterCore.probe_result`. Outcome: whether the worker's state changed."""

    worker: str
    outcome: str
    failures: int = 0


Action: TypeAlias = (
    Send
    | Close
    | Route
    | Balance
    | Tick
    | Register
    | Expect
    | Claim
    | Learn
    | Release
    | Sync
    | Lose
    | Drain
    | Retire
    | Probe
)
Step: TypeAlias = At | tuple[Action, object] | tuple[Action, object, Changes]

# -- outcomes -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fwd:
    """A `Forward` decision, by worker id."""

    worker: str
    session: str | None = None
    boot: str | None = None


@dataclass(frozen=True, slots=True)
class Ans:
    """An `Answer` decision (its detail is checked to be a sentence, not compared)."""

    code: str
    session: str | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Ticked:
    """A `TickResult`, by worker ids."""

    lost: tuple[str, ...] = ()
    exited: tuple[str, ...] = ()
    recovery_ended: bool = False


def ok(request_id: object, **extra: Any) -> dict[str, Any]:
    """The expected success reply."""
    return {"id": request_id, "ok": True, **extra}


def err(request_id: object, error: str, **extra: Any) -> dict[str, Any]:
    """The expected error reply; its `detail` is checked to be a sentence."""
    return {"id": request_id, "ok": False, "error": error, **extra}


def hello(
    request_id: object,
    worker: str,
    *,
    boot: str = "b0",
    url: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A hello line; the url defaults to a loopback port derived from the worker id."""
    message = {"op": "hello", "id": request_id, "v": 1, "worker": worker, "boot": boot}
    message["url"] = url if url is not None else default_url(worker)
    return {**message, **extra}


def default_url(worker: str) -> str:
    return f"http://127.0.0.1:{9000 + sum(map(ord, worker)) % 1000}"


def policy(
    *,
    allowed_uids: Iterable[int] = (),
    allowed_upstreams: Iterable[str] = (),
    secret: str | None = None,
    spawned_ids: Iterable[str] = (),
) -> ControlPolicy:
    return ControlPolicy(
        own_uid=OWN_UID,
        allowed_uids=frozenset(allowed_uids),
        allowed_upstreams=frozenset(allowed_upstreams),
        secret=secret,
        router_boot=ROUTER_BOOT,
        spawned_ids=frozenset(spawned_ids),
    )


def _is_sentence(detail: object) -> bool:
    return isinstance(detail, str) and len(detail) > 3 and detail.endswith(".")


# -- the playbook -------------------------------------------------------------------


@dataclass(slots=True)
class Playbook:
    """One core, its control connections and a fake clock; `run` plays steps on them."""

    settings: CoreSettings
    control: ControlPolicy = field(default_factory=policy)
    peers: Mapping[str, Peer] = field(default_factory=dict)  # conn name → peer (default Unix)
    now: float = 0.0
    core: RouterCore = field(init=False)
    connections: dict[str, ControlSession] = field(init=False, default_factory=dict)
    retired: Counter[str] = field(init=False, default_factory=Counter)
    keys: set[tuple[str, str]] = field(init=False, default_factory=set)
    state: Snapshot = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.core = RouterCore(self.settings, self.now, on_retire=self._on_retire)
        self.state = self.snapshot()

    def _on_retire(self, worker: Worker) -> None:
        self.retired[worker.id] += 1

    def run(self, steps: Sequence[Step]) -> Playbook:
        """Play `steps` in order, asserting each outcome and the whole state after it."""
        for number, step in enumerate(steps, 1):
            if isinstance(step, At):
                assert step.t >= self.now, f"step {number}: the clock goes forward only"
                self.now = step.t
                continue
            action, expected = step[0], step[1]
            changes: Changes = step[2] if len(step) == 3 else {}
            where = f"step {number} at t={self.now}: {action}"
            outcome = self.perform(action)
            if isinstance(outcome, dict) and isinstance(expected, dict):
                outcome = _without_checked_detail(outcome, expected, where)
            assert outcome == expected, f"{where}\n  expected {expected!r}\n  got      {outcome!r}"
            want, got = apply_changes(self.state, changes), self.snapshot()
            assert got == want, f"{where}: the state is not as declared\n{diff(want, got)}"
            self.state = got
        return self

    # -- snapshot -----------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        snapshot = claims_snapshot(self.core.claims, self.keys)
        for worker in self.core.workers:
            snapshot[W(worker.id)] = self._worker_view(worker)
        for worker_id, count in self.retired.items():
            snapshot[R(worker_id)] = count
        if self.core.conflicts:
            snapshot[CONFLICTS] = self.core.conflicts
        return snapshot

    def _worker_view(self, worker: Worker) -> str:
        words = [worker.state.value]
        if worker.origin is not WorkerOrigin.CONTROL:
            words.append(worker.origin.value)
        if worker.draining:
            words.append("draining")
        if worker.generation:
            words.append(f"g{worker.generation}")
        if worker.boot is not None and worker.boot != "b0":
            words.append(f"boot={worker.boot}")
        if worker.lease is not None:
            names = [name for name, conn in self.connections.items() if conn is worker.lease]
            words.append("@" + (names[0] if names else "?"))
        return " ".join(words)

    # -- actions ------------------------------------------------------------------

    def worker(self, worker_id: str) -> Worker:
        found = self.core.workers.get(worker_id)
        assert found is not None, f"no worker {worker_id!r}"
        return found

    def connection(self, name: str) -> ControlSession:
        if name not in self.connections:
            peer = self.peers.get(name, UNIX_PEER)
            self.connections[name] = ControlSession(self.core, self.control, peer)
        return self.connections[name]

    def perform(self, action: Action) -> object:
        core, now = self.core, self.now
        match action:
            case Send(conn, message):
                return self._send(conn, message)
            case Close(conn):
                lost = self.connection(conn).closed(now)
                return None if lost is None else lost.id
            case Route(key, kind):
                if kind is not None and key is not None:
                    self.keys.add((kind, key))
                return decision_view(core.route(kind, key, now))
            case Balance(exclude):
                return decision_view(core.balance(None, exclude))
            case Tick(leased):
                if leased is None:
                    silent = [w for w in core.workers if w.lease is not None]
                else:
                    silent = [self.worker(w) for w in leased]
                result = core.tick(now, silent)
                return Ticked(
                    tuple(w.id for w in result.lost),
                    tuple(w.id for w in result.exited),
                    result.recovery_ended,
                )
            case Register(worker, url, origin, boot):
                core.register(worker, url, origin, now, boot)
                return None
            case Expect(worker):
                core.expect(worker)
                return None
            case Claim(worker, key, kind):
                self.keys.add((kind, key))
                return core.claim(self.worker(worker), kind, key, now)
            case Learn(worker, key, kind):
                self.keys.add((kind, key))
                return core.claims.claim(kind, key, worker, now, learned=True)
            case Release(worker, key, kind):
                self.keys.add((kind, key))
                return core.release(self.worker(worker), kind, key, now)
            case Sync(worker, claims):
                self.keys.update(claims)
                return core.sync(self.worker(worker), claims, now)
            case Lose(worker):
                core.lose(self.worker(worker), now)
                return None
            case Drain(worker, on):
                self.worker(worker).draining = on
                return None
            case Retire(worker):
                return core.retire(self.worker(worker), now)
            case Probe(worker, outcome, failures):
                return core.probe_result(self.worker(worker), outcome, failures, now)
        raise AssertionError(f"unknown action {action!r}")

    def _send(self, conn: str, message: Mapping[str, Any] | bytes) -> dict[str, Any]:
        if isinstance(message, bytes):
            line = message
        else:
            line = json.dumps(message).encode()
            self._note_keys(message)
        request = decode_line(line)
        reply = request if "ok" in request else self.connection(conn).handle(request, self.now)
        # What goes on the wire: one compact line that parses back to the same reply.
        wire = encode_line(reply)
        assert wire.endswith(b"\n") and wire.count(b"\n") == 1, wire
        decoded: dict[str, Any] = json.loads(wire)
        assert decoded == reply, (decoded, reply)
        return decoded

    def _note_keys(self, message: Mapping[str, Any]) -> None:
        entries = message.get("claims")
        for entry in [message, *(entries if isinstance(entries, list) else [])]:
            if isinstance(entry, dict):
                kind, key = entry.get("kind", "episode"), entry.get("key")
                if isinstance(kind, str) and isinstance(key, str):
                    self.keys.add((kind, key))


def decision_view(decision: Forward | Answer) -> Fwd | Ans:
    if isinstance(decision, Forward):
        return Fwd(decision.worker.id, decision.session, decision.boot)
    assert _is_sentence(decision.detail), decision
    return Ans(decision.code, decision.session, decision.retry_after_s)


def _without_checked_detail(
    reply: dict[str, Any], expected: Mapping[str, Any], where: str
) -> dict[str, Any]:
    if "detail" in reply and "detail" not in expected:
        assert _is_sentence(reply["detail"]), f"{where}: detail {reply['detail']!r}"
        return {name: value for name, value in reply.items() if name != "detail"}
    return reply
