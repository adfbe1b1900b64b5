"""The benchmark's episodes: tokens minted as a worker mints them, and the routing check.

This module owns the fixed set of episodes a run uses (each dealt to one worker,
which claims it over the control socket), the check, before any figure is
taken, that a proxy routes every token where it should, and the choice of a
token set that a proxy spreads evenly over the workers (for the worker-bound
throughput run, where an uneven hash would make one worker the limit). It never
measures time.
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

__all__ = ["Episode", "balanced_tokens", "check_routing", "mint_episodes", "routed_workers"]


@dataclass(frozen=True, slots=True)
class Episode:
    """One episode attempt: its token, its claim key, and the worker that claims it."""

    token: str
    key: str
    worker: str


def mint_episodes(
    count: int, workers: int, worker_prefix: str = "w", episode_prefix: str = "bench"
) -> list[Episode]:
    """`count` episodes, minted as a worker would, dealt round-robin to the workers
    `{worker_prefix}0` .. `{worker_prefix}{workers - 1}`. Two sets with different
    `episode_prefix`es have different claim keys, so both can be claimed at once."""
    key = SigningKey.generate("HS256")
    now = int(time.time())
    episodes = []
    for i in range(count):
        ep = f"{episode_prefix}-{i:05d}"
        token = mint_token(ep=ep, att=0, nonce=new_nonce(), key=key, iat=now)
        episodes.append(Episode(token, episode_key(ep, 0), f"{worker_prefix}{i % workers}"))
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


def check_routing(name: str, port: int, episodes: Sequence[Episode]) -> list[str]:
    """The router sends each token to the worker that claimed it; a peer sends each
    token to one worker every time. Raises RuntimeError otherwise; returns the worker
    that answered each episode, in order."""
    tokens = [e.token for e in episodes]
    first = routed_workers(port, tokens)
    if name == "router":
        wrong = [e.key for e, w in zip(episodes, first, strict=True) if w != e.worker]
        if wrong:
            raise RuntimeError(f"the router sent {len(wrong)} episodes to the wrong worker")
        return first
    again = routed_workers(port, tokens)
    if first != again:
        raise RuntimeError(f"{name} is not sticky on {TOKEN_HEADER}")
    return first


def balanced_tokens(tokens: Sequence[str], answered: Sequence[str], workers: int) -> list[str]:
    """The largest subset of `tokens` (in their order) that sends as many tokens to
    each of `workers` workers, given the worker that `answered` each token. Cycled
    through, it loads every worker equally. Raises RuntimeError when a worker got none."""
    if len(tokens) != len(answered):
        raise ValueError(f"{len(tokens)} tokens but {len(answered)} answers")
    counts: dict[str, int] = {}
    for worker in answered:
        counts[worker] = counts.get(worker, 0) + 1
    if len(counts) < workers:
        raise RuntimeError(f"the tokens reach {len(counts)} of {workers} workers: {counts}")
    each = min(counts.values())
    taken: dict[str, int] = {}
    chosen = []
    for token, worker in zip(tokens, answered, strict=True):
        if taken.get(worker, 0) < each:
            taken[worker] = taken.get(worker, 0) + 1
            chosen.append(token)
    return chosen
