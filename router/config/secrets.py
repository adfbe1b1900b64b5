"""Secrets: `*_env` and `*_file` keys resolved to bytes, and public key files checked.

This module owns where a secret may come from (an environment variable or a
file, never inline in the configuration), the minimum secret lengths, the
size bound on secret files, and the check that a PEM file holds a public key
of the type its algorithm needs.

It must never put a secret's value in an error message or log it.
"""

from __future__ import annotations

import re
from typing import Final

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from router.config.errors import quote
from router.config.reader import Section

MAX_SECRET_FILE_BYTES: Final = 64 << 10
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
INLINE_SECRET: Final = "inline secrets are not allowed; use {0}_env or {0}_file"
_MIN_SHARED_SECRET: Final = 16  # bytes: guessing must be hopeless for a listener on the network
MIN_HS256_SECRET: Final = 32  # bytes: RFC 7518 §3.2, a key at least as long as the hash


def inline_refused(base: str) -> dict[str, str]:
    return {base: INLINE_SECRET.format(base)}


def _from_env(sec: Section, key: str) -> bytes:
    name = sec.text(key)
    if not _ENV_NAME.fullmatch(name):
        raise sec.fail(key, f"{quote(name)} is not an environment variable name")
    value = sec.ctx.env.get(name)
    if not value:
        raise sec.fail(key, f"environment variable {name} is not set or is empty")
    return value.encode("utf-8", "surrogateescape")


def secret_from_file(sec: Section, key: str) -> bytes:
    path = sec.text(key)
    if sec.ctx.read_file is None:
        raise sec.fail(key, f"cannot read {quote(path)}: no file reader is available here")
    try:
        data = sec.ctx.read_file(path)
    except OSError as exc:
        raise sec.fail(key, f"cannot read {quote(path)}: {exc.strerror or exc}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise sec.fail(key, f"{quote(path)} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    return data


def _strip_newline(data: bytes) -> bytes:
    """One trailing newline goes: editors and `echo` add it, and it is never part of a secret."""
    return data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data


def find_secret(sec: Section, base: str, min_bytes: int) -> tuple[str, bytes] | None:
    """(key, secret) from `{base}_env` or `{base}_file` (at most one), or None if neither is set."""
    keys = [k for k in (f"{base}_env", f"{base}_file") if sec.has(k)]
    if len(keys) > 1:
        raise sec.fail(keys[1], f"set only one of {base}_env and {base}_file")
    return (keys[0], read_secret(sec, keys[0], min_bytes)) if keys else None


def read_secret(sec: Section, key: str, min_bytes: int) -> bytes:
    """The secret a `*_env` or `*_file` key names, at least `min_bytes` long."""
    value = (
        _from_env(sec, key) if key.endswith("_env") else _strip_newline(secret_from_file(sec, key))
    )
    if len(value) < min_bytes:
        unit = "byte" if min_bytes == 1 else "bytes"
        raise sec.fail(key, f"the secret must be at least {min_bytes} {unit}, got {len(value)}")
    return value


def secret_text(sec: Section, base: str, *, header_safe: bool) -> tuple[str, str] | None:
    found = find_secret(sec, base, _MIN_SHARED_SECRET)
    if found is None:
        return None
    key, value = found
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise sec.fail(key, "the secret is not UTF-8") from None
    if "\0" in text:  # spawned workers get it in their environment, which cannot hold one
        raise sec.fail(key, "the secret must not contain a NUL byte")
    if header_safe and not all("!" <= c <= "~" for c in text):
        raise sec.fail(key, "the token must be visible ASCII: it travels in an HTTP header")
    return key, text


def public_key_problem(alg: str, pem: bytes) -> str | None:
    try:
        key = load_pem_public_key(pem)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return "the file is not a PEM public key (SubjectPublicKeyInfo)"
    if alg == "EdDSA" and not isinstance(key, ed25519.Ed25519PublicKey):
        return "EdDSA needs an Ed25519 public key"
    if alg == "ES256" and not (
        isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1)
    ):
        return "ES256 needs a P-256 (secp256r1) public key"
    return None
