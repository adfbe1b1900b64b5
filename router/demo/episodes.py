"""The episodes one demo worker holds, the worker's half of the token contract, and the tools.

Shared by the worker's plain HTTP endpoints (`router.demo`) and its MCP
endpoint (`router.demo.mcp`). This module owns what an episode attempt is
(EpisodeState: what its token must say, and a toy counter), the episodes a
worker holds (HeldEpisodes: it mints each attempt's token, and checks the
signature, `ep`, `att` and nonce of the token every call carries; design §2),
the refusal every demo endpoint answers with (DemoError, carrying its status
and error code), the checks on a request's arguments, reading a request's JSON
body, and the tools themselves (`add`, `get`, `echo`, `sleep`; `stream` is
named here and written by each endpoint).

It must never talk to the router or write a response: `router.demo` claims
and releases episodes, and each endpoint turns a DemoError into its own kind
of answer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from router.tokens import SigningKey, TokenError, episode_key, mint_token, new_nonce, parse_token

__all__ = [
    "MAX_ADD",
    "MAX_SLEEP_S",
    "MAX_STREAM_EVENTS",
    "MAX_STREAM_INTERVAL_S",
    "STREAM_TOOL",
    "TOKEN_HEADER",
    "TOOLS",
    "DemoError",
    "EpisodeState",
    "HeldEpisodes",
    "Tool",
    "bad_request",
    "episode_request",
    "int_arg",
    "read_json",
    "seconds_arg",
    "signing_key_from_env",
]

TOKEN_HEADER = "X-NeMo-Gym-Episode-Token"
MAX_SLEEP_S = 30.0  # `sleep` exists to hold a request open, not a worker
MAX_STREAM_EVENTS = 1000  # enough to test a long stream, few enough to end quickly
MAX_STREAM_INTERVAL_S = 10.0  # under the router's default stream idle timeout
MAX_ADD = 2**53  # the counter stays exact in every JSON implementation


class DemoError(Exception):
    """A request the demo worker refuses: `status`, and a JSON body with `error` and `detail`."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


class EpisodeState:
    """One episode attempt held by this worker: what its token must say, and its toy state."""

    __slots__ = ("att", "calls", "counter", "ep", "nonce")

    def __init__(self, ep: str, att: int, nonce: str) -> None:
        self.ep = ep
        self.att = att
        self.nonce = nonce
        self.counter = 0
        self.calls: list[str] = []

    @property
    def key(self) -> str:
        return episode_key(self.ep, self.att)

    def matches(self, ep: str, att: int, nonce: str) -> bool:
        """True when a token's claims name this very attempt (nonce compared in constant time)."""
        same_nonce = hmac.compare_digest(nonce.encode(), self.nonce.encode())
        return same_nonce and ep == self.ep and att == self.att


class HeldEpisodes:
    """The episode attempts one worker holds, by key, and which one a request's token names."""

    __slots__ = ("_by_key", "_signing_key", "_verifier", "worker_id")

    def __init__(self, worker_id: str, signing_key: SigningKey) -> None:
        self.worker_id = worker_id
        self._signing_key = signing_key
        self._verifier = signing_key.verifier()
        self._by_key: dict[str, EpisodeState] = {}

    def open(self, ep: str, att: int) -> tuple[EpisodeState, str]:
        """Hold a new attempt and return it with its token.

        Raises DemoError: 400 when no token can name this attempt, 409 when this
        worker already holds it.
        """
        state = EpisodeState(ep, att, new_nonce())
        try:
            token = mint_token(ep=ep, att=att, nonce=state.nonce, key=self._signing_key, iat=_now())
        except ValueError as exc:
            raise bad_request(f"Cannot start this episode: {exc}.") from None
        if state.key in self._by_key:
            raise DemoError(409, "episode_exists", "This worker already runs this attempt.")
        self._by_key[state.key] = state
        return state, token

    def drop(self, key: str) -> None:
        """Stop holding the attempt `key` (KeyError when it is not held)."""
        del self._by_key[key]

    def for_request(self, request: web.Request) -> EpisodeState:
        """The episode this request's token names, checked against what this worker holds."""
        values = request.headers.getall(TOKEN_HEADER, [])
        if not values:
            raise DemoError(401, "invalid_token", f"The request carries no {TOKEN_HEADER}.")
        if len(set(values)) > 1:
            raise DemoError(400, "ambiguous_session", "The token header is repeated.")
        try:
            token = parse_token(values[0], now=time.time(), verifier=self._verifier)
        except TokenError as exc:
            raise DemoError(exc.status, exc.code, exc.detail) from None
        state = self._by_key.get(token.key)
        if state is None:
            detail = f"Worker {self.worker_id} holds no episode {token.key}."
            raise DemoError(404, "unknown_episode", detail)
        if not state.matches(token.ep, token.att, token.nonce):
            raise DemoError(403, "bad_nonce", "The token is not the one issued for this episode.")
        return state

    def reply(self, state: EpisodeState, result: object) -> dict[str, object]:
        """The body a call on `state` answers with: this worker, the episode, and `result`."""
        return {
            "worker": self.worker_id,
            "episode": state.key,
            "result": result,
            "calls": len(state.calls),
        }


def signing_key_from_env(environ: Mapping[str, str]) -> SigningKey:
    """HS256 with EPISODE_TOKEN_SECRET when set (ValueError if under 32 bytes), else random."""
    secret = environ.get("EPISODE_TOKEN_SECRET")
    if secret:
        return SigningKey.hs256(secret.encode())
    return SigningKey.generate("HS256")


def _now() -> int:
    return int(time.time())


# --- pure argument checks ---------------------------------------------------------------------


def bad_request(detail: str) -> DemoError:
    """A 400 `bad_request` refusal saying `detail`."""
    return DemoError(400, "bad_request", detail)


def int_arg(args: object, name: str, low: int, high: int) -> int:
    """`args[name]` as an integer within [low, high], or a 400."""
    value = args.get(name) if isinstance(args, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(f"`{name}` must be an integer from {low} to {high}.")
    return value


def seconds_arg(args: object, name: str, high: float) -> float:
    """`args[name]` as a number of seconds within [0, high], or a 400."""
    value = args.get(name) if isinstance(args, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
        raise bad_request(f"`{name}` must be a number of seconds from 0 to {high:g}.")
    return float(value)


def episode_request(body: object) -> tuple[str, int]:
    """The (ep, att) a `POST /episodes` body asks for; ep defaults to a fresh random id."""
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    ep = body.get("ep", f"ep-{secrets.token_hex(8)}")
    att = body.get("att", 0)
    if not isinstance(ep, str) or isinstance(att, bool) or not isinstance(att, int):
        raise bad_request("`ep` must be a string and `att` an integer.")
    return ep, att


# --- tools ------------------------------------------------------------------------------------

Tool = Callable[[EpisodeState, object], Awaitable[object]]


async def _add(state: EpisodeState, args: object) -> object:
    state.counter += int_arg(args, "value", -MAX_ADD, MAX_ADD)
    return state.counter


async def _get(state: EpisodeState, args: object) -> object:
    return state.counter


async def _echo(state: EpisodeState, args: object) -> object:
    return args


async def _sleep(state: EpisodeState, args: object) -> object:
    seconds = seconds_arg(args, "seconds", MAX_SLEEP_S)
    await asyncio.sleep(seconds)
    return seconds


TOOLS: dict[str, Tool] = {"add": _add, "get": _get, "echo": _echo, "sleep": _sleep}
STREAM_TOOL = "stream"


# --- request bodies ---------------------------------------------------------------------------


async def read_json(request: web.Request, *, default: object) -> object:
    """The request's JSON body (`default` when empty); 400 if it is not JSON, 413 if too big."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise DemoError(413, "payload_too_large", "The body is over 1 MiB.") from None
    if not body.strip():
        return default
    try:
        return json.loads(body)
    except ValueError:
        raise bad_request("The body is not JSON.") from None
