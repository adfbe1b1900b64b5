"""The episode token: a compact JWS naming one attempt of one episode (design §2).

This module owns the token's wire format: strict structural parsing, signature
verification with the edge key, and minting for workers. It is pure: it must
never import asyncio or aiohttp, read a clock (callers pass ``now``), log, or
touch the network. Every malformed or forged token becomes a :class:`TokenError`
carrying its answer code; no other exception escapes :func:`parse_token`.

The keys (:class:`TokenVerifier`, :class:`SigningKey`) live in
:mod:`router.tokens.keys` and :class:`TokenError` in :mod:`router.tokens.errors`;
both are re-exported here, so callers import everything from this module.
"""

# Why base64 and JSON are handled the way they are (parse_token runs on every request):
# - One precompiled regex checks the whole token in a single pass: three non-empty
#   base64url segments, no padding, no length that is 1 mod 4, and no set bits in a
#   segment's unused tail (canonical encoding, so a signature has exactly one spelling).
#   A valid token pays for that one match; only a rejected token takes the slow path,
#   which looks again to name the precise fault.
# - Decoding uses binascii.a2b_base64, which is lenient (it skips characters outside the
#   alphabet); that is safe here only because the regex has already admitted nothing else.
# - json.loads(bytes) guesses UTF-16/32 and would accept them, so bytes are decoded as
#   strict UTF-8 first. One module-level JSONDecoder (the C scanner) rejects duplicate
#   keys, which another JWS library could resolve differently, and NaN/Infinity, which
#   are not JSON. Deep nesting raises RecursionError, caught like any JSON error.
#   raw_decode() is tried before decode() to skip decode()'s whitespace regexes.
# - Claim types are checked with `type(x) is int`, which also refuses bool (True == 1).

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from router.tokens.errors import TokenError as TokenError
from router.tokens.errors import TokenErrorCode as TokenErrorCode
from router.tokens.errors import _show
from router.tokens.keys import _SIGNATURE_BYTES
from router.tokens.keys import ALGORITHMS as ALGORITHMS
from router.tokens.keys import MIN_HS256_SECRET_BYTES as MIN_HS256_SECRET_BYTES
from router.tokens.keys import SigningKey as SigningKey
from router.tokens.keys import TokenVerifier as TokenVerifier

MAX_TOKEN_BYTES: Final = 4096  # design §2 ("at most 4 KiB"); bounds the cost of every parse
MAX_EP_CHARS: Final = 128  # design §2: keeps episode keys short in the claim table and logs
MAX_ATT: Final = 1_000_000  # design §2: far beyond any real retry count
MAX_NONCE_CHARS: Final = 256  # a 128-bit nonce needs 22 characters; 256 leaves room for any scheme

_B64 = "[A-Za-z0-9_-]"
# Non-empty, unpadded, canonical: a 2-char tail ends in a char whose low 4 bits are 0,
# a 3-char tail in one whose low 2 bits are 0. Possessive `*+` keeps matching linear.
_SEGMENT_PATTERN = rf"(?={_B64})(?:{_B64}{{4}})*+(?:{_B64}[AQgw]|{_B64}{{2}}[AEIMQUYcgkosw048])?"
_SEGMENT: Final = re.compile(_SEGMENT_PATTERN)
_COMPACT_JWS: Final = re.compile(rf"({_SEGMENT_PATTERN})\.({_SEGMENT_PATTERN})\.{_SEGMENT_PATTERN}")
_B64_CHARS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_EP_CHARS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")
_EP: Final = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_EP_CHARS}}}")
_PADDING: Final = (b"", b"", b"==", b"=")  # indexed by len % 4; 1 never reaches it
_FROM_URLSAFE: Final = bytes.maketrans(b"-_", b"+/")
_SEGMENT_NAMES: Final = ("header", "payload", "signature")
_MISSING: Final = object()


@dataclass(frozen=True, slots=True)
class EpisodeToken:
    """The claims of a structurally valid token (and a verified one, if a key was given)."""

    ep: str
    att: int
    nonce: str
    iat: int
    exp: int | None
    alg: str
    kid: str | None

    @property
    def key(self) -> str:
        """The episode key, ``"{ep}-a{att}"``: each attempt has its own claim."""
        return episode_key(self.ep, self.att)


def episode_key(ep: str, att: int) -> str:
    """Return the claim-table key of attempt ``att`` of episode ``ep``."""
    return f"{ep}-a{att}"


def parse_token(token: str, *, now: float, verifier: TokenVerifier | None = None) -> EpisodeToken:
    """Parse a compact JWS episode token, checking structure, claims and expiry at ``now``.

    With a ``verifier`` the signature is checked too, after everything else, so a
    malformed token is 401 even when verification is on. Returns the claims;
    raises TokenError (``invalid_token`` or ``bad_signature``) and nothing else.
    """
    # Hot path: one regex match for the whole structure, then two decodes and the
    # claim checks; the slow diagnosis runs only for tokens that fail the match.
    match = (
        _COMPACT_JWS.fullmatch(token)
        if isinstance(token, str) and len(token) <= MAX_TOKEN_BYTES
        else None
    )
    if match is None:
        raise _structure_error(token)
    alg, kid = _read_header(_decode_object(match.group(1), "header"))
    payload = _decode_object(match.group(2), "payload")
    claims = EpisodeToken(*_read_claims(payload, now), alg=alg, kid=kid)
    if verifier is not None:
        end = match.end(2)
        verifier.verify(alg, token[:end].encode("ascii"), _b64decode(token[end + 1 :]))
    return claims


def mint_token(
    *,
    ep: str,
    att: int,
    nonce: str,
    key: SigningKey,
    iat: int,
    exp: int | None = None,
    kid: str | None = None,
) -> str:
    """Return a compact JWS for attempt ``att`` of episode ``ep``, signed with ``key``.

    The claims are checked as :func:`parse_token` checks them (except expiry);
    raises ValueError on a bad claim or a token over the size limit.
    """
    problems = (
        ("ep", _ep_problem(ep)),
        ("att", _att_problem(att)),
        ("nonce", _nonce_problem(nonce)),
        ("iat", _int_problem(iat)),
        ("exp", None if exp is None else _int_problem(exp)),
        ("kid", None if kid is None or type(kid) is str else _type_problem(kid, "a string")),
    )
    for name, problem in problems:
        if problem is not None:
            raise ValueError(f"{name} {problem}")
    header: dict[str, object] = {"alg": key.alg, "typ": "JWT"}
    if kid is not None:
        header["kid"] = kid
    payload: dict[str, object] = {"ep": ep, "att": att, "nonce": nonce, "iat": iat}
    if exp is not None:
        payload["exp"] = exp
    signing_input = f"{_b64json(header)}.{_b64json(payload)}"
    token = f"{signing_input}.{_b64encode(key.sign(signing_input.encode('ascii')))}"
    if len(token) > MAX_TOKEN_BYTES:
        raise ValueError(f"the token would be {len(token)} bytes, over {MAX_TOKEN_BYTES}")
    return token


def new_nonce() -> str:
    """A fresh 128-bit random nonce, URL-safe (22 characters)."""
    return secrets.token_urlsafe(16)


# --- structure -------------------------------------------------------------------------


def _structure_error(token: object) -> TokenError:
    """Name the first structural fault of a token that failed the compact-JWS match."""
    if not isinstance(token, str):
        return _invalid(f"The token is {_json_type(token)}, not a string.")
    if not token:
        return _invalid("The token is empty.")
    if len(token) > MAX_TOKEN_BYTES:
        return _invalid(f"The token is longer than the {MAX_TOKEN_BYTES}-byte limit.")
    if not token.isascii():
        return _invalid("The token contains non-ASCII characters.")
    segments = token.split(".")
    if len(segments) != 3:
        count = f"{len(segments)} segment{'' if len(segments) == 1 else 's'}"
        return _invalid(f"The token has {count}, not the 3 of a compact JWS.")
    for name, segment in zip(_SEGMENT_NAMES, segments, strict=True):
        problem = _segment_problem(segment)
        if problem is not None:
            return _invalid(f"The token's {name} segment {problem}.")
    return _invalid("The token is not a compact JWS.")  # unreachable: the checks cover the regex


def _segment_problem(segment: str) -> str | None:
    if not segment:
        return "is empty"
    if "=" in segment:
        return "has '=' padding, which a compact JWS never carries"
    for char in segment:
        if char not in _B64_CHARS:
            return f"contains {char!r}, outside the base64url alphabet"
    if len(segment) % 4 == 1:
        return f"has {len(segment)} characters, a length no base64url encoding has"
    if _SEGMENT.fullmatch(segment) is None:
        return "has unused trailing bits set (not canonical base64url)"
    return None


def _b64decode(segment: str) -> bytes:
    # Only called on segments the regex admitted, so this cannot fail. Translating the
    # ASCII bytes and calling binascii directly is about twice as fast as urlsafe_b64decode.
    data = segment.encode("ascii").translate(_FROM_URLSAFE)
    return binascii.a2b_base64(data + _PADDING[len(segment) & 3])


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64json(value: dict[str, object]) -> str:
    return _b64encode(json.dumps(value, separators=(",", ":")).encode("ascii"))


# --- JSON ------------------------------------------------------------------------------


class _JsonRefused(ValueError):
    """Valid-looking JSON the token format refuses; the message is a predicate phrase."""


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _JsonRefused(f"has the key {_show(name)} more than once")
            seen.add(name)
    return obj


def _refuse_constant(name: str) -> NoReturn:
    raise _JsonRefused(f"contains {name}, which is not JSON")


_JSON: Final = json.JSONDecoder(object_pairs_hook=_object_pairs, parse_constant=_refuse_constant)


def _parse_json(text: str) -> Any:
    # decode() runs two whitespace regexes around raw_decode(); a token's JSON almost
    # never has whitespace outside its object, so try raw_decode() alone first.
    if text.startswith("{"):
        value, end = _JSON.raw_decode(text)
        if end == len(text):
            return value
    return _JSON.decode(text)


def _decode_object(segment: str, name: str) -> dict[str, Any]:
    """Decode a header or payload segment into a JSON object, or raise invalid_token."""
    try:
        value = _parse_json(_b64decode(segment).decode("utf-8"))
    except _JsonRefused as exc:
        raise _invalid(f"The token's {name} {exc}.") from None
    except UnicodeDecodeError:
        raise _invalid(f"The token's {name} is not valid UTF-8.") from None
    except (ValueError, RecursionError):
        raise _invalid(f"The token's {name} is not valid JSON.") from None
    if type(value) is not dict:
        raise _invalid(f"The token's {name} is {_json_type(value)}, not a JSON object.")
    return value


# --- header and claims -----------------------------------------------------------------


def _read_header(header: dict[str, Any]) -> tuple[str, str | None]:
    """Return (alg, kid) of a header, or raise invalid_token."""
    alg = header.get("alg", _MISSING)
    if type(alg) is not str or alg not in _SIGNATURE_BYTES:
        raise _invalid(_alg_problem(alg))
    typ = header.get("typ", _MISSING)
    if typ is not _MISSING and (type(typ) is not str or typ.upper() != "JWT"):
        raise _invalid(_typ_problem(typ))
    if "kid" in header and type(header["kid"]) is not str:
        raise _invalid(f"The token's kid {_type_problem(header['kid'], 'a string')}.")
    kid = header.get("kid")
    if "crit" in header:
        raise _invalid("The token's header has crit; the router supports no JWS extensions.")
    return alg, kid


def _alg_problem(alg: object) -> str:
    if alg is _MISSING:
        return "The token's header has no alg."
    if type(alg) is not str:
        return f"The token's alg {_type_problem(alg, 'a string')}."
    if alg.lower() == "none":
        return "The token is unsecured (alg none), which is never accepted."
    return f"The token's alg {_show(alg)} is not one of {', '.join(ALGORITHMS)}."


def _typ_problem(typ: object) -> str:
    if type(typ) is not str:
        return f"The token's typ {_type_problem(typ, 'a string')}."
    return f"The token's typ {_show(typ)} is not JWT, the only type accepted."


def _read_claims(payload: dict[str, Any], now: float) -> tuple[str, int, str, int, int | None]:
    """Return (ep, att, nonce, iat, exp) of a payload, or raise invalid_token."""
    ep = payload.get("ep", _MISSING)
    att = payload.get("att", 0)
    nonce = payload.get("nonce", _MISSING)
    iat = payload.get("iat", _MISSING)
    exp = payload.get("exp")
    for name, problem in (
        ("ep", _ep_problem(ep)),
        ("att", _att_problem(att)),
        ("nonce", _nonce_problem(nonce)),
        ("iat", _int_problem(iat)),
        ("exp", _int_problem(exp) if "exp" in payload else None),
    ):
        if problem is not None:
            raise _invalid(f"The claim {name} {problem}.")
    if exp is not None and exp <= now:
        raise _invalid(f"The token expired (exp {exp} is not after now {int(now)}).")
    return ep, att, nonce, iat, exp


def _ep_problem(ep: object) -> str | None:
    if type(ep) is not str:
        return _type_problem(ep, "a string")
    if _EP.fullmatch(ep) is not None:
        return None
    if not 1 <= len(ep) <= MAX_EP_CHARS:
        return f"must be 1 to {MAX_EP_CHARS} characters long, not {len(ep)}"
    bad = next(char for char in ep if char not in _EP_CHARS)
    return f"contains {bad!r}, outside [A-Za-z0-9._:-]"


def _att_problem(att: object) -> str | None:
    if type(att) is not int:
        return _type_problem(att, "an integer")
    if not 0 <= att <= MAX_ATT:
        return f"must be 0 to {MAX_ATT}, not {att}"
    return None


def _nonce_problem(nonce: object) -> str | None:
    if type(nonce) is not str:
        return _type_problem(nonce, "a string")
    if not 1 <= len(nonce) <= MAX_NONCE_CHARS:
        return f"must be 1 to {MAX_NONCE_CHARS} characters long, not {len(nonce)}"
    return None


def _int_problem(value: object) -> str | None:
    return None if type(value) is int else _type_problem(value, "an integer")


def _type_problem(value: object, wanted: str) -> str:
    if value is _MISSING:
        return "is missing"
    return f"must be {wanted}, not {_json_type(value)}"


# --- helpers ---------------------------------------------------------------------------
_JSON_TYPES: Final = {
    bool: "a boolean",
    int: "an integer",
    float: "a number with a fraction or exponent",
    str: "a string",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def _invalid(detail: str) -> TokenError:
    return TokenError("invalid_token", detail)


def _json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), f"a {type(value).__name__}")
