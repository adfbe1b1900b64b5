"""The token cache past its bound: which tokens it keeps while every request misses.

With more live tokens than the cache holds, rotated through in turn, every request
misses and drops the oldest entry. These tests follow the entries kept through many
such drops (the dict it kept before slowed down with them: docs/performance.md, "The
router against nginx at thousands of episodes"), counting signature checks to tell a
hit (none) from a parse (one).
"""

from __future__ import annotations

from router.tokens import SigningKey, TokenVerifier, mint_token
from router.tokens.cache import TokenCache

NOW = 1_700_000_000.0
SECRET = b"0123456789abcdef0123456789abcdef"
KEY = SigningKey.hs256(SECRET)


class CountingVerifier(TokenVerifier):
    """An HS256 verifier that counts the signatures it checks: a cache hit checks none."""

    __slots__ = ("checked",)

    def __init__(self) -> None:
        super().__init__("HS256", SECRET)
        self.checked = 0

    def verify(self, alg: str, signing_input: bytes, signature: bytes) -> None:
        self.checked += 1
        super().verify(alg, signing_input, signature)


def tokens(count: int, nonce_size: int = 16) -> list[str]:
    return [
        mint_token(ep=f"ep{i}", att=0, nonce="n" * nonce_size, key=KEY, iat=1) for i in range(count)
    ]


def checks(verifier: CountingVerifier, cache: TokenCache, token: str) -> int:
    """How many signatures `cache.key(token)` checked: 0 for a hit, 1 for a parse."""
    before = verifier.checked
    cache.key(token, NOW)
    return verifier.checked - before


def test_rotated_past_its_bound_the_cache_keeps_the_newest_and_drops_the_oldest() -> None:
    verifier = CountingVerifier()
    cache = TokenCache(verifier, max_entries=3)
    rotation = tokens(10)
    for _ in range(300):  # 3,000 misses, each dropping the oldest entry
        for token in rotation:
            assert checks(verifier, cache, token) == 1
    assert len(cache) == 3
    assert [checks(verifier, cache, token) for token in rotation[-3:]] == [0, 0, 0]
    assert checks(verifier, cache, rotation[6]) == 1  # parsed, and rotation[7] dropped
    assert [checks(verifier, cache, token) for token in (rotation[8], rotation[9])] == [0, 0]
    assert checks(verifier, cache, rotation[6]) == 0
    assert checks(verifier, cache, rotation[7]) == 1
    assert len(cache) == 3


def test_a_hit_does_not_make_an_entry_newer() -> None:
    # Dropped in the order they came in, used or not: the bound is on what is kept.
    verifier = CountingVerifier()
    cache = TokenCache(verifier, max_entries=2)
    first, second, third = tokens(3)
    cache.key(first, NOW)
    cache.key(second, NOW)
    assert checks(verifier, cache, first) == 0
    cache.key(third, NOW)  # drops `first`, the oldest in, though used last but one
    assert checks(verifier, cache, second) == 0
    assert checks(verifier, cache, first) == 1


def test_the_bytes_kept_stay_counted_through_many_drops() -> None:
    # Were a dropped entry's length not taken off, the byte bound would hold fewer
    # tokens after each pass; were it taken twice, more.
    rotation = tokens(7, nonce_size=256)
    size = len(rotation[0])
    assert all(len(token) == size for token in rotation)
    verifier = CountingVerifier()
    cache = TokenCache(verifier, max_bytes=3 * size + 10)
    for _ in range(200):
        for token in rotation:
            cache.key(token, NOW)
    assert len(cache) == 3
    assert [checks(verifier, cache, token) for token in rotation[-3:]] == [0, 0, 0]
    assert checks(verifier, cache, rotation[0]) == 1
    assert len(cache) == 3
