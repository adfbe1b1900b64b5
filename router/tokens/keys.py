"""The episode token's keys (design §2): the edge's `TokenVerifier` and a worker's `SigningKey`.

This module owns the signing algorithms (HS256, EdDSA, ES256), loading and
checking key material (secret length, PEM key type, curve), signing, and
signature verification. `router.tokens` re-exports both classes.

It is pure: it must never import asyncio or aiohttp, read a clock, log, or
touch the network, and never put key material in a message or a repr.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Final

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from router.tokens.errors import TokenError, _show

MIN_HS256_SECRET_BYTES: Final = 32  # RFC 7518 §3.2: the key must be at least the hash size

ALGORITHMS: Final = ("HS256", "EdDSA", "ES256")
_SIGNATURE_BYTES: Final = {"HS256": 32, "EdDSA": 64, "ES256": 64}  # ES256 is raw r||s
_ECDSA_SHA256: Final = ec.ECDSA(hashes.SHA256())

_PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey
_PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey

_KEY_ADVICE: Final = "use an Ed25519 key (EdDSA) or an EC P-256 key (ES256)"


class TokenVerifier:
    """The edge verification key. ``alg`` is ``HS256``, ``EdDSA`` or ``ES256``.

    Build one with :meth:`hs256`, :meth:`from_public_pem` or :meth:`from_config`.
    """

    __slots__ = ("_key", "alg")

    def __init__(self, alg: str, key: bytes | _PublicKey) -> None:
        self.alg = alg
        self._key = key

    def __repr__(self) -> str:
        return f"TokenVerifier(alg={self.alg!r})"

    @classmethod
    def hs256(cls, secret: bytes) -> TokenVerifier:
        """Verify HS256 tokens with a shared secret; ValueError if it is under 32 bytes."""
        return cls("HS256", _check_secret(secret))

    @classmethod
    def from_public_pem(cls, pem: bytes) -> TokenVerifier:
        """Verify with an Ed25519 (EdDSA) or EC P-256 (ES256) public key in PEM.

        Raises ValueError for anything else, naming what was found.
        """
        try:
            key = serialization.load_pem_public_key(pem)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ValueError(f"not a PEM public key the router can read ({exc})") from None
        if isinstance(key, ed25519.Ed25519PublicKey):
            return cls("EdDSA", key)
        if isinstance(key, ec.EllipticCurvePublicKey):
            _check_curve(key.curve)
            return cls("ES256", key)
        raise ValueError(f"{_key_type(key)} keys are not supported; {_KEY_ADVICE}")

    @classmethod
    def from_config(cls, alg: str, material: bytes) -> TokenVerifier:
        """Build the verifier a config names: an HS256 secret, or an EdDSA/ES256 PEM key.

        Raises ValueError if ``alg`` is unknown or the key is not for ``alg``.
        """
        if alg == "HS256":
            return cls.hs256(material)
        if alg not in ALGORITHMS:
            raise ValueError(f"alg must be one of {', '.join(ALGORITHMS)}, not {_show(alg)}")
        verifier = cls.from_public_pem(material)
        if verifier.alg != alg:
            raise ValueError(f"alg is {alg} but the PEM key is for {verifier.alg}")
        return verifier

    def verify(self, alg: str, signing_input: bytes, signature: bytes) -> None:
        """Check ``signature`` over ``signing_input``; the token's ``alg`` must be ours.

        Raises TokenError('bad_signature') on an alg mismatch, a wrong-length
        signature or a signature that does not verify.
        """
        if alg != self.alg:
            detail = f"The token is signed with {_show(alg)} but the router verifies {self.alg}."
            raise TokenError("bad_signature", detail)
        expected = _SIGNATURE_BYTES[alg]
        if len(signature) != expected:
            detail = f"An {alg} signature is {expected} bytes long, not {len(signature)}."
            raise TokenError("bad_signature", detail)
        if not _signature_matches(self._key, signing_input, signature):
            raise TokenError("bad_signature", "The token's signature does not match the key.")


class SigningKey:
    """A worker's key for minting tokens. ``alg`` is ``HS256``, ``EdDSA`` or ``ES256``."""

    __slots__ = ("_key", "alg")

    def __init__(self, alg: str, key: bytes | _PrivateKey) -> None:
        self.alg = alg
        self._key = key

    def __repr__(self) -> str:
        return f"SigningKey(alg={self.alg!r})"

    @classmethod
    def hs256(cls, secret: bytes) -> SigningKey:
        """Sign HS256 tokens with a shared secret; ValueError if it is under 32 bytes."""
        return cls("HS256", _check_secret(secret))

    @classmethod
    def from_private_pem(cls, pem: bytes) -> SigningKey:
        """Sign with an unencrypted Ed25519 or EC P-256 private key in PEM; ValueError otherwise."""
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ValueError(f"not an unencrypted PEM private key ({exc})") from None
        if isinstance(key, ed25519.Ed25519PrivateKey):
            return cls("EdDSA", key)
        if isinstance(key, ec.EllipticCurvePrivateKey):
            _check_curve(key.curve)
            return cls("ES256", key)
        raise ValueError(f"{_key_type(key)} keys are not supported; {_KEY_ADVICE}")

    @classmethod
    def generate(cls, alg: str) -> SigningKey:
        """A fresh random key: 32 secret bytes for HS256, else a new key pair."""
        if alg == "HS256":
            return cls(alg, secrets.token_bytes(MIN_HS256_SECRET_BYTES))
        if alg == "EdDSA":
            return cls(alg, ed25519.Ed25519PrivateKey.generate())
        if alg == "ES256":
            return cls(alg, ec.generate_private_key(ec.SECP256R1()))
        raise ValueError(f"alg must be one of {', '.join(ALGORITHMS)}, not {_show(alg)}")

    def public_pem(self) -> bytes | None:
        """The public key in PEM (SubjectPublicKeyInfo) for edge verification; None for HS256."""
        if isinstance(self._key, bytes):
            return None
        return self._key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def verifier(self) -> TokenVerifier:
        """The TokenVerifier that accepts this key's signatures."""
        key = self._key
        return TokenVerifier(self.alg, key if isinstance(key, bytes) else key.public_key())

    def sign(self, signing_input: bytes) -> bytes:
        """The JWS signature of ``signing_input`` (ES256 as raw 32-byte r || 32-byte s)."""
        key = self._key
        if isinstance(key, bytes):
            return hmac.digest(key, signing_input, "sha256")
        if isinstance(key, ed25519.Ed25519PrivateKey):
            return key.sign(signing_input)
        r, s = decode_dss_signature(key.sign(signing_input, _ECDSA_SHA256))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes):
        raise TypeError(f"an HS256 secret must be bytes, not {type(secret).__name__}")
    if len(secret) < MIN_HS256_SECRET_BYTES:
        raise ValueError(
            f"an HS256 secret must be at least {MIN_HS256_SECRET_BYTES} bytes (RFC 7518 §3.2),"
            f" not {len(secret)}"
        )
    return secret


def _check_curve(curve: ec.EllipticCurve) -> None:
    if not isinstance(curve, ec.SECP256R1):
        raise ValueError(f"an EC key on {curve.name} is not supported; ES256 needs P-256")


def _key_type(key: object) -> str:
    return type(key).__name__.lstrip("_")


def _signature_matches(key: bytes | _PublicKey, signing_input: bytes, signature: bytes) -> bool:
    if isinstance(key, bytes):
        return hmac.compare_digest(hmac.digest(key, signing_input, "sha256"), signature)
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, signing_input)
        else:
            r, s = int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
            key.verify(encode_dss_signature(r, s), signing_input, _ECDSA_SHA256)
    except InvalidSignature:
        return False
    return True
