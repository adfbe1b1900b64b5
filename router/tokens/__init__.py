"""The episode token (design §2): parse, verify, mint, and the checked-token cache.
Workers import these names from `router.tokens`. Pure: no I/O.
"""

from __future__ import annotations

from router.tokens.cache import TokenCache
from router.tokens.errors import (
    RefusalCode,
    RefusedValue,
)
from router.tokens.jws import (
    ALGORITHMS,
    MAX_ATT,
    MAX_EP_CHARS,
    MAX_NONCE_CHARS,
    MAX_TOKEN_BYTES,
    MIN_HS256_SECRET_BYTES,
    EpisodeToken,
    SigningKey,
    TokenError,
    TokenErrorCode,
    TokenVerifier,
    episode_key,
    mint_token,
    new_nonce,
    parse_token,
)

__all__ = [
    "ALGORITHMS",
    "MAX_ATT",
    "MAX_EP_CHARS",
    "MAX_NONCE_CHARS",
    "MAX_TOKEN_BYTES",
    "MIN_HS256_SECRET_BYTES",
    "EpisodeToken",
    "RefusalCode",
    "RefusedValue",
    "SigningKey",
    "TokenCache",
    "TokenError",
    "TokenErrorCode",
    "TokenVerifier",
    "annotations",
    "episode_key",
    "mint_token",
    "new_nonce",
    "parse_token",
]
