"""The directory's Lua scripts: read from the files beside this module, loaded into Redis
with SCRIPT LOAD, run with EVALSHA.

Each script is `scripts/common.lua` followed by its own file. A Redis that forgot its
scripts (a restart, SCRIPT FLUSH, a failover to a replica that never loaded them)
answers NOSCRIPT: the script is loaded again and the call sent once more.

A call that must survive a failover (a claim, under Sentinel) is sent with WAIT in the
same round trip: Redis answers once that many replicas hold the write. A primary that
a failover left behind has no replica following it any more, so its writes are never
acknowledged; Redis replicates asynchronously, and without WAIT a claim written there
is acknowledged and then lost when it turns into a replica (seen in
tests/directory/test_sentinel.py).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from importlib import resources

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from router.directory.errors import DirectoryUnavailable


class Script(enum.Enum):
    """The directory's scripts, by the name of their file."""

    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    CLAIM = "claim"
    RELEASE = "release"
    RETIRE = "retire"
    SWEEP = "sweep"
    LOOKUP = "lookup"
    WORKERS = "workers"


def script_source(script: Script) -> str:
    """The full text of `script`: the shared prelude, then its own file."""
    folder = resources.files("router.directory").joinpath("scripts")
    common = folder.joinpath("common.lua").read_text(encoding="utf-8")
    return common + "\n" + folder.joinpath(f"{script.value}.lua").read_text(encoding="utf-8")


class ScriptRunner:
    """Runs the directory's scripts on one Redis client by their SHA1."""

    __slots__ = ("_sha", "_source")

    def __init__(self) -> None:
        self._source = {script: script_source(script) for script in Script}
        # Redis names a script by the SHA1 of its text: known here without asking it.
        self._sha = {
            script: hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
            for script, text in self._source.items()
        }

    def sha(self, script: Script) -> str:
        return self._sha[script]

    def source(self, script: Script) -> str:
        return self._source[script]

    def sha_all(self) -> list[str]:
        return list(self._sha.values())

    async def load_all(self, redis: Redis) -> None:
        """SCRIPT LOAD every script (once at start; NOSCRIPT reloads one later)."""
        for text in self._source.values():
            await redis.script_load(text)

    async def run(
        self, redis: Redis, script: Script, keys: Sequence[str], args: Sequence[str | int]
    ) -> object:
        """EVALSHA `script` with `keys` and `args`; on NOSCRIPT, load it and run it again."""
        sha = self._sha[script]
        try:
            return await redis.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            await redis.script_load(self._source[script])
            return await redis.evalsha(sha, len(keys), *keys, *args)

    async def run_replicated(
        self,
        redis: Redis,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        replicas: int,
        wait_ms: int,
    ) -> object:
        """`run`, answered only once `replicas` replicas hold its writes (WAIT, within
        `wait_ms`, pipelined with the call on one connection); DirectoryUnavailable when
        fewer did in time (the writes stay on this primary, unacknowledged)."""
        for _ in range(2):  # once more after NOSCRIPT
            pipe = redis.pipeline(transaction=False)
            pipe.evalsha(self._sha[script], len(keys), *keys, *args)
            pipe.wait(replicas, max(wait_ms, 1))
            reply, acknowledged = await pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError):
                await redis.script_load(self._source[script])
                continue
            if isinstance(reply, Exception):
                raise reply
            if isinstance(acknowledged, Exception):
                raise acknowledged
            if int(acknowledged) < replicas:
                raise DirectoryUnavailable(
                    f"{acknowledged} of {replicas} replicas acknowledged the write in {wait_ms} ms"
                )
            return reply
        raise NoScriptError("the script was loaded and is still unknown")
