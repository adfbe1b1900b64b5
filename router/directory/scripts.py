"""The directory's Lua scripts: read from the files beside this module, loaded into Redis
with SCRIPT LOAD, run with EVALSHA.

Each script is `scripts/common.lua` followed by its own file. A Redis that forgot its
scripts (a restart, SCRIPT FLUSH, a failover to a replica that never loaded them)
answers NOSCRIPT: the script is loaded again and the call sent once more.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from importlib import resources

from redis.asyncio import Redis
from redis.exceptions import NoScriptError


class Script(enum.Enum):
    """The directory's scripts, by the name of their file."""

    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    CLAIM = "claim"
    RELEASE = "release"
    RETIRE = "retire"
    SWEEP = "sweep"
    LOOKUP = "lookup"


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
