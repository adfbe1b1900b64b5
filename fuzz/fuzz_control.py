"""Fuzz target: the control protocol's codec and session (DESIGN §3), fed any byte stream.

Each input is one connection's bytes, cut into lines as the control server cuts them.
`decode_line` must never raise and always give a dict; a `ControlSession` (two of them
share one core, so claims can conflict) must answer every request with its id, never
raise, and every reply must encode as exactly one JSON line. Any other outcome is a
finding.

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

from fuzz_harness import instrumented, run

with instrumented():
    from router.control import ControlPolicy, ControlSession, Peer, decode_line, encode
    from router.core import CoreSettings, RouterCore

NAME = "control"
UID = 1000
POLICY = ControlPolicy(UID, frozenset({2000}), frozenset(), "shared-secret", "router-boot")
PEERS = (Peer(uid=UID, tcp=False), Peer(uid=None, tcp=True))
SETTINGS = CoreSettings(kinds={"episode": False, "open": True}, recovery_window_s=0.0)


def seeds() -> list[bytes]:
    """Conversations that reach every op, on both sessions, with a few broken lines."""
    w0 = {"v": 1, "worker": "w0", "url": "http://127.0.0.1:9001", "boot": "b0"}
    w1 = {"v": 1, "worker": "w1", "url": "unix:/run/w1.sock", "boot": "b1", "auth": "shared-secret"}
    lines = [
        {"op": "hello", "id": 1, **w0},
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
    other = [b"\x01" + json.dumps({"op": "hello", "id": 1, **w1}).encode()]
    other.append(b"\x01" + json.dumps({"op": "claim", "id": 2, "key": "ep2-a0"}).encode())
    broken = [b"", b"{", b"[]", b'{"op":5,"id":[1]}', b'{"op":"nope","id":null}', b"\xff"]
    return [
        b"\n".join(script),
        b"\n".join([*script[:3], *other, *script[3:]]),
        b"\n".join(broken),
        b"\x02\n".join(script),
    ]


def check(data: bytes) -> None:
    """One connection's bytes: a line starting 0x01 goes to the second session, and one
    starting 0x02 closes the first session's connection (a fresh one takes its place)."""
    core = RouterCore(SETTINGS, 0.0)
    sessions = [ControlSession(core, POLICY, peer) for peer in PEERS]
    for now, line in enumerate(data.split(b"\n"), start=1):
        which = 0
        if line[:1] == b"\x02":
            sessions[0].closed(float(now))
            sessions[0] = ControlSession(core, POLICY, PEERS[0])
            line = line[1:]
        elif line[:1] == b"\x01":
            which, line = 1, line[1:]
        if not line.strip():
            continue
        _answer(sessions[which], line, float(now))


def _answer(session: ControlSession, line: bytes, now: float) -> None:
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
    wire = encode(reply)
    assert wire.endswith(b"\n") and wire.count(b"\n") == 1, wire


def main(argv: list[str]) -> int:
    """Fuzz with atheris, or with --replay run the seeds and the given files once."""
    return run(argv, NAME, check, seeds)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
