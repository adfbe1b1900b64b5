"""The benchmark's episodes: tokens minted as a worker mints them, and the routing check.

This module owns the fixed set of episodes a run uses (each dealt to one worker,
which claims it over the control socket) and the check, before any figure is
taken, that a proxy routes every token where it should. It never measures time.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench import load
from bench.peers import TOKEN_HEADER
from router.tokens import SigningKey, episode_key, mint_token, new_nonce

__all__ = ["Episode", "check_routing", "mint_episodes", "routed_workers"]


@dataclass(frozen=True, slots=True)
class Episode:
    """One episode attempt: its token, its claim key, and the worker that claims it."""

    token: str
    key: str
    worker: str


def mint_episodes(count: int, workers: int) -> list[Episode]:
    """`count` episodes, minted as a worker would, dealt round-robin to the workers."""
    key = SigningKey.generate("HS256")
    now = int(time.time())
    episodes = []
    for i in range(count):
        ep = f"bench-{i:05d}"
        token = mint_token(ep=ep, att=0, nonce=new_nonce(), key=key, iat=now)
        episodes.append(Episode(token, episode_key(ep, 0), f"w{i % workers}"))
    return episodes


def routed_workers(port: int, tokens: Sequence[str]) -> list[str]:
    """The worker that answers each token, in order (one keep-alive connection).
    Raises RuntimeError on a reply that is not 200 from a bench worker."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    answered = []
    try:
        for token in tokens:
            connection.request(
                "POST", load.REQUEST_PATH, body=load.REQUEST_BODY, headers={TOKEN_HEADER: token}
            )
            reply = connection.getresponse()
            body = reply.read()
            if reply.status != 200:
                raise RuntimeError(f"status {reply.status}: {body[:200]!r}")
            answered.append(str(json.loads(body)["worker"]))
    finally:
        connection.close()
    return answered


def check_routing(name: str, port: int, episodes: Sequence[Episode]) -> None:
    """The router sends each token to the worker that claimed it; a peer sends each
    token to one worker every time. Raises RuntimeError otherwise."""
    tokens = [e.token for e in episodes]
    first = routed_workers(port, tokens)
    if name == "router":
        wrong = [e.key for e, w in zip(episodes, first, strict=True) if w != e.worker]
        if wrong:
            raise RuntimeError(f"the router sent {len(wrong)} episodes to the wrong worker")
        return
    again = routed_workers(port, tokens)
    if first != again:
        raise RuntimeError(f"{name} is not sticky on {TOKEN_HEADER}")
