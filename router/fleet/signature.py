"""The peer hop's signature (design §10, the request path, step 3): pure.

A router that forwards a request to the router holding its key adds
`X-Episode-Router-Peer: sender=<id>:<epoch>;receiver=<id>:<epoch>;ts=<ms>;sig=<hex>`,
the signature an HMAC-SHA256 (the fleet's `peer` secret) over the method, the request
target, the session kind and key, the sender, the receiver and the timestamp. The
receiving router reads the session again from the request itself and checks the
signature against what it read: a header moved to another request, or another key,
does not verify. The cryptography package's HMAC does the cryptography; this module
only frames what is signed.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Final

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.hmac import HMAC

PEER_HEADER: Final = "X-Episode-Router-Peer"
# Two routers' clocks (NTP-synchronised in a cluster) agree far better than this; a
# captured hop replays for at most this long, and only as the same request.
MAX_CLOCK_SKEW_MS: Final = 30_000
_SIGNATURE_HEX: Final = 64


# Not frozen, and its own __init__: one is made per hop received, and the compiled
# build compiles this one, where a dataclass's generated __init__ runs interpreted (it
# was a tenth of the receiving router's `verify`, perf on bench.fleet's load).
@dataclass(slots=True, init=False)
class PeerHop:
    """A verified hop: who sent it and which incarnation it was meant for."""

    sender: str  # "<router id>:<epoch>"
    receiver: str

    def __init__(self, sender: str, receiver: str) -> None:
        self.sender = sender
        self.receiver = receiver


def _digest(
    secret: bytes,
    method: str,
    target: str,
    session: tuple[str, str] | None,
    sender: str,
    receiver: str,
    timestamp_ms: int,
) -> str:
    kind, key = session if session is not None else ("", "")
    # NUL-separated: no field holds one (a request target or header value cannot), so
    # fields never run together into another request's.
    message = "\0".join((method, target, kind, key, sender, receiver, str(timestamp_ms)))
    mac = _keyed(secret).copy()
    mac.update(message.encode("utf-8", "surrogateescape"))
    return mac.finalize().hex()


# The secret's keyed HMAC, copied for each hop: a third of the cost of keying one
# afresh with the standard library's hmac (whose HMAC object is Python: about 0.8 us
# against 2.5 here; every hop is signed by one router and checked by the other). A
# reload with a new secret adds one; never more than a few are kept.
_KEYED: dict[bytes, HMAC] = {}
_MAX_KEYED = 4


def _keyed(secret: bytes) -> HMAC:
    mac = _KEYED.get(secret)
    if mac is None:
        if len(_KEYED) >= _MAX_KEYED:
            _KEYED.clear()
        mac = _KEYED[secret] = HMAC(secret, SHA256())
    return mac


def sign(
    secret: bytes,
    method: str,
    target: str,
    session: tuple[str, str] | None,
    sender: str,
    receiver: str,
    timestamp_ms: int,
) -> str:
    """The header value for one hop."""
    signature = _digest(secret, method, target, session, sender, receiver, timestamp_ms)
    return f"sender={sender};receiver={receiver};ts={timestamp_ms};sig={signature}"


def verify(
    secret: bytes,
    value: str | None,
    method: str,
    target: str,
    session: tuple[str, str] | None,
    now_ms: int,
) -> PeerHop | str:
    """The hop `value` signs, or why it is refused (missing, malformed, stale, forged)."""
    if value is None:
        return f"no {PEER_HEADER} header: the peer listener takes only signed hops"
    fields = _fields(value)
    if fields is None:
        return f"a malformed {PEER_HEADER} header"
    sender, receiver, stamp, signature = fields
    if not (stamp.isascii() and stamp.isdigit() and len(stamp) <= 16):
        return f"a malformed {PEER_HEADER} timestamp"
    if len(signature) != _SIGNATURE_HEX or not signature.isascii():
        # compare_digest takes ASCII text only (it raises on any other).
        return f"a malformed {PEER_HEADER} signature"
    timestamp_ms = int(stamp)
    expected = _digest(secret, method, target, session, sender, receiver, timestamp_ms)
    if not hmac.compare_digest(expected, signature):
        return "the hop's signature does not match this request"
    if abs(now_ms - timestamp_ms) > MAX_CLOCK_SKEW_MS:
        return "the hop's timestamp is stale"
    return PeerHop(sender, receiver)


_NAMES: Final = ("sender", "receiver", "ts", "sig")


def _fields(value: str) -> tuple[str, str, str, str] | None:
    """The sender, receiver, timestamp and signature a header value names, each once,
    in any order; None when it names anything else, or any twice."""
    parts = value.split(";")
    if len(parts) != len(_NAMES):
        return None
    if (
        parts[0].startswith("sender=")
        and parts[1].startswith("receiver=")
        and parts[2].startswith("ts=")
        and parts[3].startswith("sig=")
    ):
        # The order `sign` writes: no dictionary for it (this runs for every hop).
        return parts[0][7:], parts[1][9:], parts[2][3:], parts[3][4:]
    fields: dict[str, str] = {}
    for part in parts:
        name, sep, text = part.partition("=")
        if not sep or name in fields or name not in _NAMES:
            return None
        fields[name] = text
    return fields["sender"], fields["receiver"], fields["ts"], fields["sig"]
