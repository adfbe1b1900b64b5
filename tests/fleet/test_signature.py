"""Pure tests for the peer hop's signature (design §10, step 3): no event loop."""

from __future__ import annotations

import pytest

from router.fleet import MAX_CLOCK_SKEW_MS, PeerHop, sign, verify

SECRET = b"0123456789abcdef0123456789abcdef"
NOW = 1_800_000_000_000
SESSION = ("episode", "ep7-a0")


def signed(**changes: object) -> str:
    fields: dict[str, object] = {
        "secret": SECRET,
        "method": "POST",
        "target": "/tools/get?x=1",
        "session": SESSION,
        "sender": "r2:5",
        "receiver": "r1:7",
        "timestamp_ms": NOW,
    }
    fields.update(changes)
    return sign(**fields)  # type: ignore[arg-type]


def test_a_hop_verifies_against_the_request_it_was_signed_for() -> None:
    hop = verify(SECRET, signed(), "POST", "/tools/get?x=1", SESSION, NOW + 1)
    assert hop == PeerHop(sender="r2:5", receiver="r1:7")


def test_a_sessionless_hop_signs_no_session() -> None:
    assert isinstance(
        verify(SECRET, signed(session=None), "POST", "/tools/get?x=1", None, NOW), PeerHop
    )
    assert isinstance(
        verify(SECRET, signed(session=None), "POST", "/tools/get?x=1", SESSION, NOW), str
    )


@pytest.mark.parametrize(
    ("method", "target", "session"),
    [
        ("GET", "/tools/get?x=1", SESSION),  # another method
        ("POST", "/tools/get?x=2", SESSION),  # another target
        ("POST", "/tools/get?x=1", ("episode", "ep8-a0")),  # another key
        ("POST", "/tools/get?x=1", ("mcp", "ep7-a0")),  # another kind
    ],
)
def test_a_hop_moved_to_another_request_does_not_verify(
    method: str, target: str, session: tuple[str, str]
) -> None:
    assert verify(SECRET, signed(), method, target, session, NOW) == (
        "the hop's signature does not match this request"
    )


def test_another_secret_or_changed_parties_do_not_verify() -> None:
    assert isinstance(verify(b"x" * 32, signed(), "POST", "/tools/get?x=1", SESSION, NOW), str)
    forged = signed().replace("receiver=r1:7", "receiver=r1:8")
    assert isinstance(verify(SECRET, forged, "POST", "/tools/get?x=1", SESSION, NOW), str)


@pytest.mark.parametrize("skew", [MAX_CLOCK_SKEW_MS + 1, -(MAX_CLOCK_SKEW_MS + 1)])
def test_a_stale_or_future_timestamp_is_refused(skew: int) -> None:
    value = signed(timestamp_ms=NOW - skew)
    assert (
        verify(SECRET, value, "POST", "/tools/get?x=1", SESSION, NOW)
        == "the hop's timestamp is stale"
    )
    at_the_edge = signed(timestamp_ms=NOW - (MAX_CLOCK_SKEW_MS if skew > 0 else -MAX_CLOCK_SKEW_MS))
    assert isinstance(verify(SECRET, at_the_edge, "POST", "/tools/get?x=1", SESSION, NOW), PeerHop)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "sender=r2:5",
        "sender=r2:5;receiver=r1:7;ts=1;sig=00",  # a short signature
        "sender=r2:5;receiver=r1:7;ts=x;sig=" + "0" * 64,
        "sender=r2:5;receiver=r1:7;ts=1;sig=" + "0" * 64 + ";extra=1",
        "sender=r2:5;sender=r2:6;receiver=r1:7;ts=1;sig=" + "0" * 64,
        "sender=r2:5;receiver=r1:7;ts=" + "9" * 40 + ";sig=" + "0" * 64,
        "sender=r2:5;receiver=r1:7;ts=1;sig=" + "\u00e9" * 64,  # obs-text, not hex
        "sender=r2:5;receiver=r1:7;sig=" + "0" * 64 + ";sig=" + "0" * 64,
        "sender=r2:5;receiver=r1:7;ts=1;other=" + "0" * 64,
        "garbage without fields",
    ],
)
def test_a_missing_or_malformed_header_is_refused_with_a_reason(value: str | None) -> None:
    reason = verify(SECRET, value, "POST", "/tools/get?x=1", SESSION, NOW)
    assert isinstance(reason, str) and reason


def test_a_hop_whose_fields_come_in_another_order_verifies() -> None:
    # `sign` writes one order; any order of the same four fields is the same hop.
    sender, receiver, stamp, signature = signed().split(";")
    reordered = ";".join((signature, stamp, receiver, sender))
    hop = verify(SECRET, reordered, "POST", "/tools/get?x=1", SESSION, NOW)
    assert hop == PeerHop(sender="r2:5", receiver="r1:7")
