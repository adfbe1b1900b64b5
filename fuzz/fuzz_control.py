"""Fuzz target: the control protocol's codec and session (design §3), fed any byte stream.

Each input is one connection's bytes, cut into lines as the control server cuts them,
and is played on two cores that start alike: the server's way (`_answer_lines`: the
claim/release fast path `ControlSession.answer_claim_or_release` first, the general path
when it declines) and always the general way (`decode_line`, `handle`, `encode`). For
every line both must give the same reply bytes and leave the cores alike (the claims
each worker holds, tombstones, workers, leases), and when the fast path answers, its op
and result must be the reply's. On the general path `decode_line` must never raise and
always give a dict, a `ControlSession` must answer every request with its id and never
raise, and every reply must encode as exactly one JSON line. Any other outcome is a
finding.

A line starting 0x01 goes to the second connection (two share a core, so claims can
conflict); 0x02 first closes the first connection (a fresh one takes its place); 0x03
first moves the clock on and ticks the core as the service does, so leases go silent,
graces end and tombstones expire.

Coverage-guided, with atheris (libFuzzer flags; crashes are written as `crash-*` files
in the working directory unless `-artifact_prefix=` says otherwise):

    python fuzz/fuzz_control.py -runs=100000 [corpus_dir ...]

An empty corpus directory is first filled with the seeds below; without one, a folder in
the system's temporary directory is used (and kept for later runs). Without atheris,
`python fuzz/fuzz_control.py --replay [file ...]` runs the seeds (and the files) once.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from fuzz_harness import instrumented, run

with instrumented():
    from router.control.session import ControlPolicy, ControlSession, Peer
    from router.core.machine import CoreSettings, RouterCore
    from router.protocol.control import decode_line, encode_line

NAME = "control"
UID = 1000
POLICY = ControlPolicy(UID, frozenset({2000}), frozenset(), "shared-secret", "router-boot")
PEERS = (Peer(uid=UID, tcp=False), Peer(uid=None, tcp=True))
# A short tombstone life and a small tombstone cap, so that a few ticks and a few dozen
# lines reach expiry and eviction (a key forgotten can be claimed again).
SETTINGS = CoreSettings(
    kinds={"episode": False, "open": True},
    recovery_window_s=0.0,
    tombstone_ttl_s=25.0,
    max_tombstones=8,
)
TICK_STEP_S = 10.0  # a tick line's clock jump: two of them outlast the 15 s lease timeout
W0 = {"v": 1, "worker": "w0", "url": "http://127.0.0.1:9001", "boot": "b0"}
W1 = {"v": 1, "worker": "w1", "url": "unix:/run/w1.sock", "boot": "b1", "auth": "shared-secret"}


class _Side:
    """One core and the sessions of its two connections."""

    def __init__(self) -> None:
        self.core = RouterCore(SETTINGS, 0.0)
        self.sessions = [ControlSession(self.core, POLICY, peer) for peer in PEERS]

    def reconnect(self, which: int, now: float) -> None:
        self.sessions[which].closed(now)
        self.sessions[which] = ControlSession(self.core, POLICY, PEERS[which])

    def tick(self, now: float) -> None:
        """The service's tick: leases gone silent are lost and their connections closed."""
        leased = [w for w in self.core.workers if w.lease is not None]
        lost = self.core.tick(now, leased).lost
        for which, session in enumerate(self.sessions):
            if session.worker is not None and session.worker in lost:
                self.reconnect(which, now)

    def state(self) -> tuple[object, ...]:
        """What the core and the connections show: claims held per worker and their keys,
        tombstones and their count, workers, and whose lease each connection holds."""
        claims = self.core.claims
        held = sorted((c.kind, c.key, c.worker, c.since, c.last_used) for c in claims.held())
        ended = sorted(
            (c.kind, c.key, c.worker, c.state.value, c.since) for c in claims.tombstones()
        )
        workers = sorted(
            (
                w.id,
                w.state.value,
                w.last_heard,
                w.lost_since,
                w.draining,
                claims.held_count(w.id),
                sorted((c.kind, c.key) for c in claims.held_by(w.id)),
            )
            for w in self.core.workers
        )
        leases = [s.worker.id if s.worker is not None else None for s in self.sessions]
        counts = (claims.held_total, claims.tombstone_count, self.core.conflicts)
        return held, ended, workers, leases, counts


def check(data: bytes) -> None:
    """One input, line by line, on the server's side and the general side."""
    served, reference = _Side(), _Side()
    now = 0.0
    for line in data.split(b"\n"):
        now += 1.0
        which, prefix = 0, line[:1]
        if prefix == b"\x01":
            which = 1
        elif prefix == b"\x02":
            for side in (served, reference):
                side.reconnect(0, now)
        elif prefix == b"\x03":
            now += TICK_STEP_S
            for side in (served, reference):
                side.tick(now)
        if prefix in (b"\x01", b"\x02", b"\x03"):
            line = line[1:]
        fast = served.sessions[which].answer_claim_or_release(line, now)
        if fast is not None:
            answer = fast[2]
        else:
            answer = _answer(served.sessions[which], line, now) if line.strip() else b""
        expected = _answer(reference.sessions[which], line, now) if line.strip() else b""
        assert answer == expected, (line, answer, expected)
        assert served.state() == reference.state(), (line, served.state(), reference.state())
        if fast is not None:
            reply = json.loads(expected)
            result = "ok" if reply["ok"] else reply["error"]
            assert fast[:2] == (json.loads(line)["op"], result), (line, fast)


def _answer(session: ControlSession, line: bytes, now: float) -> bytes:
    """The general path's reply line, with the checks every reply must pass."""
    request = decode_line(line)
    assert isinstance(request, dict), request
    if "ok" in request:
        reply = request
        assert reply["ok"] is False and reply["error"] == "bad_request", reply
    else:
        assert isinstance(request["op"], str), request
        reply = session.handle(request, now)
        assert reply.get("id") == request.get("id"), (request, reply)
    assert isinstance(reply["ok"], bool) and (reply["ok"] or isinstance(reply["error"], str))
    wire = encode_line(reply)
    assert wire.endswith(b"\n") and wire.count(b"\n") == 1, wire
    return wire


def _compact(message: dict[str, Any], to: bytes = b"") -> bytes:
    """A line as router.client writes it (no spaces), with a connection prefix."""
    return to + json.dumps(message, separators=(",", ":")).encode()


def seeds() -> list[bytes]:
    """Conversations that reach every op, on both sessions, with a few broken lines;
    then compact claim/release lines for the fast path, and lines just short of it."""
    lines = [
        {"op": "hello", "id": 1, **W0},
        {"op": "claim", "id": 2, "key": "ep1-a0"},
        {"op": "claim", "id": "c", "key": "k", "kind": "open"},
        {"op": "sync", "id": 3, "claims": [{"key": "ep1-a0"}, {"key": "ep2-a0"}], "more": True},
        {"op": "sync", "id": 4, "claims": [{"kind": "episode", "key": "ep3-a0"}], "more": False},
        {"op": "release", "id": 5, "key": "ep1-a0"},
        {"op": "drain", "id": 6, "on": True},
        {"op": "ping", "id": 7},
        {"op": "bye", "id": 8},
    ]
    script = [json.dumps(line).encode() for line in lines]
    other = [b"\x01" + json.dumps({"op": "hello", "id": 1, **W1}).encode()]
    other.append(b"\x01" + json.dumps({"op": "claim", "id": 2, "key": "ep2-a0"}).encode())
    broken = [b"", b"{", b"[]", b'{"op":5,"id":[1]}', b'{"op":"nope","id":null}', b"\xff"]
    return [
        b"\n".join(script),
        b"\n".join([*script[:3], *other, *script[3:]]),
        b"\n".join(broken),
        b"\x02\n".join(script),
        _every_outcome(),
        _near_misses(),
        _out_of_lease(),
        _ticks(),
        _many_keys(),
    ]


def _hellos() -> list[bytes]:
    return [
        _compact({"op": "hello", "id": 1, **W0}),
        _compact({"op": "hello", "id": 1, **W1}, b"\x01"),
    ]


def _every_outcome() -> bytes:
    """Both field orders (op,id,key[,kind] and op,key,kind,id) meeting every answer the
    core gives: ok, idempotent ok, conflict, not_holder, ended, worker_exited."""
    lines = [
        *_hellos(),
        b'{"op":"claim","id":2,"key":"ep1-a0"}',
        b'{"op":"claim","id":3,"key":"ep1-a0","kind":"episode"}',
        b'{"op":"claim","key":"k1","kind":"open","id":"c-1"}',
        b'\x01{"op":"claim","id":4,"key":"ep1-a0"}',
        b'\x01{"op":"claim","key":"k1","kind":"open","id":"req/7 #a~"}',
        b'\x01{"op":"release","key":"ep1-a0","kind":"episode","id":-5}',
        b'\x01{"op":"claim","key":"ep2-a0","kind":"episode","id":""}',
        b'{"op":"release","id":6,"key":"ep1-a0"}',
        b'{"op":"release","id":7,"key":"ep1-a0"}',
        b'{"op":"claim","key":"ep1-a0","kind":"episode","id":0}',
        b'{"op":"release","id":999999999999999999,"key":"never-seen"}',
        b'{"op":"release","key":"k1","kind":"open","id":-999999999999999999}',
        b'\x01{"op":"bye","id":8}',
        b'{"op":"claim","id":9,"key":"ep2-a0"}',
        b'{"op":"release","key":"ep2-a0","kind":"episode","id":10}',
    ]
    return b"\n".join(lines)


def _near_misses() -> bytes:
    """Lines one step from the fast path's shapes, which the general path must answer."""
    long_key = b"x" * 513
    lines = [
        *_hellos(),
        b'{"op": "claim", "id": 1, "key": "a"}',
        b'{"op":"claim", "id":1,"key":"a"}',
        b'{"op":"claim","id":-0,"key":"a"}',
        b'{"op":"claim","id":007,"key":"a"}',
        b'{"op":"claim","id":1.0,"key":"a"}',
        b'{"op":"claim","id":1e3,"key":"a"}',
        b'{"op":"claim","id":true,"key":"a"}',
        b'{"op":"claim","id":null,"key":"a"}',
        b'{"op":"claim","id":[1],"key":"a"}',
        b'{"op":"claim","id":1234567890123456789,"key":"a"}',
        b'{"op":"claim","id":"a\\"b","key":"a"}',
        b'{"op":"claim","id":"\\u0041","key":"a"}',
        b'{"op":"claim","id":"\xc3\xa9","key":"a"}',
        b'{"op":"claim","id":1,"key":"a\\\\b"}',
        b'{"op":"claim","id":1,"key":"\\u00e9"}',
        b'{"op":"claim","id":1,"key":"\xc3\xa9"}',
        b'{"op":"claim","id":1,"key":"a\x7f"}',
        b'{"op":"claim","id":1,"key":"a\tb"}',
        b'{"op":"claim","id":1,"key":""}',
        b'{"op":"claim","id":1,"key":"' + long_key + b'"}',
        b'{"op":"claim","id":1,"key":"' + long_key[1:] + b'"}',
        b'{"op":"claim","id":1,"key":"a","kind":"nope"}',
        b'{"op":"claim","id":1,"key":"a","kind":""}',
        b'{"op":"claim","id":1,"key":"a","kind":null}',
        b'{"op":"release","key":"a","kind":"nope","id":1}',
        b'{"op":"claim","key":"a","id":1}',
        b'{"op":"claim","id":1,"kind":"open","key":"a"}',
        b'{"op":"claim","id":1,"key":"a","key":"b"}',
        b'{"op":"claim","id":1,"key":"a","kind":"episode","x":1}',
        b'{"op":"claim","id":1,"key":"a","ok":true}',
        b'{"op":"claim","id":1,"key":"a"} ',
        b'{"op":"claim","id":1,"key":"a"}\r',
        b' {"op":"claim","id":1,"key":"a"}',
        b'{"op":"claim","id":1,"key":"a"}{"op":"claim","id":2,"key":"b"}',
        b'{"op":"Claim","id":1,"key":"a"}',
        b'{"op":"claim","id":1,"key":"a"',
    ]
    return b"\n".join(lines)


def _out_of_lease() -> bytes:
    """Fast-path lines before hello, after bye, after the connection closed, and on a
    connection whose hello was refused."""
    claim = b'{"op":"claim","id":1,"key":"a"}'
    release = b'{"op":"release","key":"a","kind":"episode","id":2}'
    lines = [
        claim,
        b"\x01" + release,
        _compact({"op": "hello", "id": 1, **W1}),  # over Unix with auth: fine
        claim,
        _compact({"op": "bye", "id": 3}),
        claim,
        release,
        _compact({"op": "hello", "id": 1, **W0}),
        claim,
        b"\x02" + claim,
        _compact({"op": "hello", "id": 4, **W0}, b"\x01"),  # no auth over TCP: forbidden
        b"\x01" + claim,
        _compact({"op": "hello", "id": 5, **W0}),
        release,
    ]
    return b"\n".join(lines)


def _ticks() -> bytes:
    """Claims, then ticks: a silent lease is lost, its worker comes back or its grace
    ends, tombstones expire, and their keys can be claimed again."""
    new_boot = {**W0, "boot": "b0-again"}
    ping = b'\x03{"op":"ping","id":"p"}'  # a tick, and w0 is heard from after it
    lines = [
        *_hellos(),
        b'{"op":"claim","id":1,"key":"ep1-a0"}',
        b'\x01{"op":"claim","key":"ep2-a0","kind":"episode","id":2}',
        b'{"op":"release","id":3,"key":"ep1-a0"}',
        ping,
        b"\x03",  # w1 is lost
        b'\x01{"op":"claim","key":"ep2-a0","kind":"episode","id":4}',
        b'{"op":"claim","id":5,"key":"ep2-a0"}',
        _compact({"op": "hello", "id": 6, **W1}, b"\x01"),  # same boot: restored
        b'\x01{"op":"claim","key":"ep2-a0","kind":"episode","id":7}',
        b"\x03",
        b"\x03",  # both are lost
        _compact({"op": "hello", "id": 8, **new_boot}),  # a new boot: w0's claims exited
        b'{"op":"claim","id":9,"key":"ep1-a0"}',
        ping,  # w1's grace ends
        b'{"op":"claim","id":10,"key":"ep2-a0"}',
        ping,
        ping,
        ping,
        b'{"op":"claim","key":"ep2-a0","kind":"episode","id":11}',
    ]
    return b"\n".join(lines)


def _many_keys() -> bytes:
    """Enough keys, claimed and released in both orders and both ways, to compact a
    worker's held list and evict tombstones past the cap."""
    lines = [*_hellos()]
    for n in range(40):
        lines.append(b'{"op":"claim","id":%d,"key":"k%d"}' % (n, n))
    for n in range(0, 40, 2):
        lines.append(b'{"op":"release","key":"k%d","kind":"episode","id":"r%d"}' % (n, n))
        lines.append(b'{"op": "release", "id": %d, "key": "k%d"}' % (n, n + 1))
    for n in range(40):
        lines.append(b'\x01{"op":"claim","key":"k%d","kind":"episode","id":%d}' % (n, n))
    return b"\n".join(lines)


def main(argv: list[str]) -> int:
    """Fuzz with atheris, or with --replay run the seeds and the given files once."""
    return run(argv, NAME, check, seeds)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
