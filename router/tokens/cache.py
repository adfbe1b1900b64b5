"""The keys of episode tokens already checked, by token text: the header token's fast path.

Every call of an episode carries the same token, so after its first request a token
costs one dict probe instead of a parse and a signature check. Kept apart from
`router.tokens` so the compiled build (setup.py) covers it: tokens.py stays Python,
its checks of a decoded token's JSON types being what refuses a hostile token.
Compiled, a hit costs less (docs/performance.md, "The hot path's trims").
"""

from __future__ import annotations

from collections import OrderedDict

from router.tokens.jws import TokenVerifier, parse_token

__all__ = ["TokenCache"]


class TokenCache:
    """The keys of tokens already parsed (and verified, with a verifier), by token text.

    Every call of an episode carries the same token, so after its first request a token
    costs one dict probe instead of a parse and a signature check. Only a token that
    passed every check is kept, under its full text, signature included: a token that
    differs in any byte is parsed anew. Expiry is checked on every hit; an expired entry
    is parsed again, so the refusal says why. At most `max_entries` are kept, holding at
    most `max_bytes` of token text (tokens may be up to 4 KiB: without a verifier, any
    well-formed one is kept), the oldest dropped first.
    """

    __slots__ = ("_bytes", "_entries", "_max_bytes", "_max_entries", "_verifier")

    def __init__(
        self,
        verifier: TokenVerifier | None,
        max_entries: int = 16_384,
        max_bytes: int = 8 << 20,
    ) -> None:
        self._verifier = verifier
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0  # the length of every token kept
        # An OrderedDict, not a dict: a dict's oldest entry is `next(iter(entries))`, and
        # a dict whose front was deleted from steps over every deleted slot until it is
        # resized: past the bound, with every request a miss, that cost about 9 µs a miss
        # at 16,384 entries, more than the parse (docs/performance.md). Its popitem(last=False)
        # drops the oldest in constant time.
        self._entries: OrderedDict[str, tuple[str, int | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, token: str, now: float) -> str:
        """The episode key `token` names; raises TokenError as `parse_token` does."""
        entry = self._entries.get(token)
        if entry is not None:
            key, exp = entry
            if exp is None or exp > now:
                return key
            del self._entries[token]
            self._bytes -= len(token)
        claims = parse_token(token, now=now, verifier=self._verifier)
        entries = self._entries
        size = len(token)
        while entries and (
            len(entries) >= self._max_entries or self._bytes + size > self._max_bytes
        ):
            oldest, _ = entries.popitem(last=False)
            self._bytes -= len(oldest)
        key = claims.key
        entries[token] = (key, claims.exp)
        self._bytes += size
        return key
