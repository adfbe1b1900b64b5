"""Fuzz target: the episode token parser (design §2), fed any header value.

`parse_token` must raise nothing but `TokenError`, with or without a verifier; a token it
accepts keeps design §2's bounds, and one that verifies names exactly what a seed signed.
Any other exception, or a broken bound, is a finding.

Coverage-guided, with atheris (libFuzzer flags; crashes are written as `crash-*` files
in the working directory unless `-artifact_prefix=` says otherwise):

    python fuzz/fuzz_tokens.py -runs=100000 [corpus_dir ...]

An empty corpus directory is first filled with the seeds below; without one, a folder in
the system's temporary directory is used (and kept for later runs). Without atheris,
`python fuzz/fuzz_tokens.py --replay [file ...]` runs the seeds (and the files) once.
"""

from __future__ import annotations

import sys

from fuzz_harness import instrumented, run

with instrumented():
    from router.tokens import (
        ALGORITHMS,
        EpisodeToken,
        SigningKey,
        TokenError,
        TokenVerifier,
        mint_token,
        parse_token,
    )

NAME = "tokens"
NOW = 1_700_000_000.0
KEYS = {
    "HS256": SigningKey.hs256(b"fuzzing-secret-of-thirty-two-bytes!"),
    "EdDSA": SigningKey.generate("EdDSA"),
    "ES256": SigningKey.generate("ES256"),
}
VERIFIERS = [KEYS[alg].verifier() for alg in ALGORITHMS]
EP_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


def seeds() -> list[bytes]:
    """Valid tokens of every alg and shape, and near misses, to start mutating from."""
    tokens = [mint_token(ep="ep-1", att=0, nonce="n0", key=KEYS[alg], iat=0) for alg in ALGORITHMS]
    tokens.append(
        mint_token(
            ep="a.b:c-d",
            att=1000000,
            nonce="x" * 256,
            key=KEYS["HS256"],
            iat=1,
            exp=int(NOW) + 60,
            kid="k1",
        )
    )
    tokens += ["", "a.b.c", "eyJhbGciOiJub25lIn0.e30.", tokens[0] + "=", tokens[0][:-1]]
    return [token.encode() for token in tokens]


SIGNED = {parse_token(seed.decode(), now=NOW) for seed in seeds()[:4]}


def check_claims(claims: EpisodeToken) -> None:
    assert 1 <= len(claims.ep) <= 128 and set(claims.ep) <= EP_CHARS, claims
    assert type(claims.att) is int and 0 <= claims.att <= 1_000_000, claims
    assert claims.key == f"{claims.ep}-a{claims.att}", claims
    assert claims.alg in ALGORITHMS and (claims.exp is None or claims.exp > NOW), claims


def check(data: bytes) -> None:
    """One input, decoded as the public listener decodes a header value."""
    token = data.decode("utf-8", "surrogateescape")
    for verifier in (None, *VERIFIERS):
        claims = _parse(token, verifier)
        if claims is None:
            continue
        check_claims(claims)
        if verifier is not None:
            assert claims in SIGNED, f"a token no seed signed verified: {token!r}"


def _parse(token: str, verifier: TokenVerifier | None) -> EpisodeToken | None:
    try:
        return parse_token(token, now=NOW, verifier=verifier)
    except TokenError as exc:
        assert exc.code in ("invalid_token", "bad_signature") and exc.detail, exc
        return None


def main(argv: list[str]) -> int:
    """Fuzz with atheris, or with --replay run the seeds and the given files once."""
    return run(argv, NAME, check, seeds)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
