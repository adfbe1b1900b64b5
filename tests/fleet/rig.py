"""The fleet rig: a real redis-server and two or three real router processes (design §10).

Each router is `episode-router run --config <file>` (`python -m router.cli`, as the e2e
tests start it) on a loopback address of its own (127.0.0.2, .3, .4: Linux routes all
of 127/8 to lo), with its public, admin and peer listeners on that address, its own
control socket in the test's folder, a `spawn:` of two demo workers, and `directory:`
at the test's redis-server with a short lease. A `Relay` (a TCP relay the test owns)
can stand between a router and Redis, or in front of a router's peer listener, so a
link can be cut for real at a true boundary.

Every process is the test's own and is stopped by its pid (the e2e `Launcher`: SIGTERM,
then SIGKILL, then the spawned workers it recorded as the router's children, checked
by their argument vectors). A paused router is resumed before it is stopped. Every wait
has a deadline.

`FleetClient` is the client of a Kubernetes Service: every request goes to a router
picked at random among those in service. It records every answer per episode and
judges it: a 200 must come from the episode's own worker with its counter one call
further, never after a 410 for that key; a 401 for a live episode is always wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.launch import free_port, free_port_range
from tests.directory.conftest import RedisServer
from tests.e2e.conftest import (
    START_TIMEOUT_S,
    TOKEN_HEADER,
    Launcher,
    Process,
    demo_worker_command,
    wait_until,
)

LEASE_S = 2.0  # short, so a lapse is seconds; the heartbeat runs every third of it
HEARTBEAT_S = LEASE_S / 3
PREFIX = "episode-router"
PEER_SECRET_ENV = "EPISODE_ROUTER_PEER_SECRET"
ADMIN_TOKEN_ENV = "EPISODE_ROUTER_ADMIN_TOKEN"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
WORKER_IDS = ("w0", "w1")
REQUEST_TIMEOUT_S = 10.0  # far above any answer the contract allows
SPAWN_STOP_TIMEOUT_S = 3.0

# What a client may be told in a fault, as (status, error code); a 200 is judged apart.
OWNER_UNREACHABLE = (503, "owner_unreachable")
RECOVERING = (503, "recovering")
WORKER_EXITED = (410, "worker_exited")
UNREACHABLE = (0, "unreachable")  # no HTTP answer: refused, reset or timed out


def free_port_on(host: str) -> int:
    """A port outside the ephemeral range that nothing listens on, on `host` too."""
    for _ in range(100):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port on {host}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a router runs: the address its listeners bind, and what its argument vector
    starts with (`ip netns exec <name>` for one in a network namespace; `ip` execs the
    router, so the pid the launcher holds is the router's own)."""

    host: str
    argv_prefix: tuple[str, ...] = ()


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy, ever


def admin_json(url: str, token: str, timeout: float = 2.0) -> tuple[int, Any] | None:
    """GET `url` with a bearer token on a new connection: (status, JSON or None), or
    None if unreachable."""
    reply = admin_get(url, token, timeout)
    return None if reply is None else (reply[0], _json_or_none(reply[1]))


def admin_get(url: str, token: str, timeout: float = 2.0) -> tuple[int, bytes] | None:
    """GET `url` with a bearer token on a new connection: (status, body), or None if
    unreachable."""
    headers = {"Connection": "close", "Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, headers=headers)
    try:
        with _DIRECT.open(request, timeout=timeout) as reply:
            return int(reply.status), reply.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), exc.read()
    except (OSError, ValueError):
        return None


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


# --- a TCP relay the test cuts -------------------------------------------------------------


class Relay:
    """A TCP relay on 127.0.0.1:`port` to `target`, in a thread of its own (the test's
    loop may block in a wait). `cut()` closes every connection and stops listening (new
    connections are refused); `mend()` listens on the same port again. `stall()` is a
    link gone silent with no close (a partition): connections stay open and new ones are
    accepted, but no byte moves until `flow()`, when what was held goes on, as TCP's
    retransmissions would deliver it."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._thread.start()
        self.mend()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=5.0)

    def mend(self) -> None:
        self._run(self._listen())

    def cut(self) -> None:
        self._run(self._cut())

    def stall(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def flow(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.set)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._pipe, "127.0.0.1", self.port, reuse_address=True
            )

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._links):
            writer.transport.abort()
        self._links.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._links.add(writer)
        await self._flowing.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._links.update((writer, up_writer))
        await asyncio.gather(
            self._copy(reader, up_writer), self._copy(up_reader, writer), return_exceptions=True
        )
        self._links.difference_update((writer, up_writer))
        for end in (writer, up_writer):
            end.transport.abort()

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await self._flowing.wait()
            chunk = await reader.read(65536)
            if not chunk:
                break
            await self._flowing.wait()  # a stall that began during the read holds it
            writer.write(chunk)
            await writer.drain()
        writer.transport.abort()


# --- the routers ---------------------------------------------------------------------------


@dataclass(slots=True)
class FleetRouter:
    """One router process of the fleet, on its own loopback address."""

    router_id: str
    host: str
    public_port: int
    admin_port: int
    peer_port: int
    config_path: Path
    process: Process
    admin_token: str
    paused: bool = False
    in_service: bool = True  # whether the Service sends it requests

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.public_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def admin(self, path: str) -> tuple[int, Any] | None:
        """GET an admin path, with the admin token (needed off loopback), on a new
        connection: (status, JSON body or None), or None if unreachable."""
        return admin_json(self.admin_url + path, self.admin_token)

    def sample(self, name: str, **labels: str) -> float:
        """One sample of the router's /metrics (0 when it has none by that name)."""
        reply = admin_get(self.admin_url + "/metrics", self.admin_token)
        assert reply is not None and reply[0] == 200, f"/metrics of {self.router_id}: {reply}"
        for family in text_string_to_metric_families(reply[1].decode()):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return 0.0

    def workers(self) -> dict[str, dict[str, Any]]:
        """The admin API's view of every worker, by id ({} while unreachable)."""
        reply = self.admin("/admin/workers")
        if reply is None or reply[0] != 200:
            return {}
        return {view["id"]: view for view in reply[1]["workers"]}

    def routers_view(self) -> dict[str, Any]:
        reply = self.admin("/admin/routers")
        assert reply is not None and reply[0] == 200, f"/admin/routers of {self.router_id}: {reply}"
        view: dict[str, Any] = reply[1]
        return view

    def epoch(self) -> int:
        epoch: int = self.routers_view()["epoch"]
        return epoch

    def signal(self, signum: signal.Signals) -> None:
        """`signum` to the router (by its pid), its spawned workers put on record first,
        so the teardown stops them should it not."""
        self.process.remember_descendants()
        self.process.signal(signum)

    def kill9(self) -> None:
        self.in_service = False
        self.signal(signal.SIGKILL)
        self.process.wait(5.0)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.process.signal(signal.SIGCONT)
        self.paused = False


class Fleet:
    """The routers of one test on one redis-server."""

    def __init__(self, launcher: Launcher, redis: RedisServer) -> None:
        self.launcher = launcher
        self.redis = redis
        self.routers: dict[str, FleetRouter] = {}
        self.relays: list[Relay] = []
        self.peer_relays: dict[str, Relay] = {}  # router id -> the relay its peers dial
        self.secret = secrets.token_hex(16)
        self.admin_token = secrets.token_hex(16)
        # Keys of every router's `directory:` section on top of the rig's own.
        # 500 ms, not 50: the suite runs these beside everything else on two cores, where
        # a lookup can be late with nothing wrong; what a late one gets is tested apart.
        self.directory_settings: dict[str, Any] = {"lookup_timeout_ms": 500}
        # The routers stand for pods (shape A): they never forward straight to each
        # other's workers, as they would on one host (shape B: `peer.direct`), even
        # where they share this one. A test of shape B turns it on.
        self.same_host = False
        # Where router i (0-based) runs: its address and what its argv starts with (a
        # network namespace's `ip netns exec`); by default 127.0.0.2-4 here.
        self.placement: Callable[[int], Placement] = lambda index: Placement(HOSTS[index])

    def relay(self, target_host: str, target_port: int) -> Relay:
        relay = Relay(target_host, target_port)
        self.relays.append(relay)
        return relay

    def start(
        self,
        count: int,
        *,
        directory_urls: dict[str, str] | None = None,
        peer_relays: Sequence[str] = (),
    ) -> list[FleetRouter]:
        """`count` routers r1..rN, started together and waited for. `directory_urls`
        replaces a router's `directory.url`; a router named in `peer_relays` advertises
        a relay in front of its peer listener (`peer_relays[router_id]`)."""
        started = []
        for index in range(count):
            router_id = f"r{index + 1}"
            url = (directory_urls or {}).get(router_id, self.redis.url)
            place = self.placement(index)
            started.append(self._launch(router_id, place, url, router_id in peer_relays))
        for router in started:
            self.wait_ready(router)
        return started

    def _launch(self, router_id: str, place: Placement, url: str, relayed: bool) -> FleetRouter:
        folder = self.launcher.root / router_id
        folder.mkdir()
        host = place.host
        # A namespace's own address is not bindable here, and nothing else uses it.
        public_port, admin_port, peer_port = (
            free_port() if place.argv_prefix else free_port_on(host) for _ in range(3)
        )
        peer: dict[str, Any] = {
            "listen": f"{host}:{peer_port}",
            "secret_env": PEER_SECRET_ENV,
            "direct": self.same_host,
        }
        if relayed:
            self.peer_relays[router_id] = self.relay(host, peer_port)
            peer["advertise"] = self.peer_relays[router_id].address
        config = {
            "listen": {"host": host, "port": public_port},
            "admin": {"host": host, "port": admin_port, "token_env": ADMIN_TOKEN_ENV},
            "control": {"socket": f"unix:{folder / 'control.sock'}", "lease_timeout_s": 3},
            "claims": {"recovery_window_s": 1},
            "timeouts": {"shutdown_grace_s": 3},
            "log": {"format": "json", "level": "warning"},
            "spawn": {
                "command": demo_worker_command(),
                "count": len(WORKER_IDS),
                "base_port": free_port_range(len(WORKER_IDS)),
                "stop_timeout_s": SPAWN_STOP_TIMEOUT_S,
            },
            "directory": {
                "url": url,
                "router_id": router_id,
                "lease_ttl_s": LEASE_S,
                **self.directory_settings,
            },
            "peer": peer,
        }
        config_path = folder / "router.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [*place.argv_prefix, sys.executable, "-m", "router.cli", "run"]
        env = {PEER_SECRET_ENV: self.secret, ADMIN_TOKEN_ENV: self.admin_token}
        process = self.launcher.start(router_id, [*argv, "--config", str(config_path)], env=env)
        router = FleetRouter(
            router_id,
            host,
            public_port,
            admin_port,
            peer_port,
            config_path,
            process,
            self.admin_token,
        )
        self.routers[router_id] = router
        return router

    def wait_ready(self, router: FleetRouter, timeout: float = START_TIMEOUT_S) -> None:
        """Until its /healthz answers, the admin API shows its workers live, and the
        directory's membership holds it."""

        def ready() -> bool:
            health = router.admin("/healthz")
            if health is None or health[0] != 200:
                return False
            views = router.workers()
            live = all(views.get(w, {}).get("state") == "live" for w in WORKER_IDS)
            return live and router.router_id in self.members()

        wait_until(f"{router.router_id} ready", ready, timeout, watch=router.process)

    # -- the directory as the test reads it --------------------------------------------

    def members(self) -> dict[str, str]:
        """`HGETALL {prefix}:members` ({} while Redis does not answer)."""
        try:
            members = self.redis.client().hgetall(f"{{{PREFIX}}}:members")
        except redis.RedisError:
            return {}
        return {str(name): str(value) for name, value in members.items()}

    def certificates(self, router_id: str) -> dict[int, str]:
        """The death certificates of `router_id`'s incarnations: epoch -> value."""
        client = self.redis.client()
        found = {}
        for name in client.scan_iter(match=f"{{{PREFIX}}}:dead:{router_id}:*", count=1000):
            found[int(str(name).rsplit(":", 1)[1])] = str(client.get(name))
        return found

    def in_service(self) -> list[FleetRouter]:
        return [r for r in self.routers.values() if r.in_service]

    def stop(self) -> None:
        """Resume what is paused, close the relays; the launcher stops the processes."""
        for router in self.routers.values():
            if router.paused:
                with contextlib.suppress(Exception):
                    router.resume()
        for relay in self.relays:
            relay.close()


# --- the Service's client, and its record of every answer ----------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """One reply to one call of an episode."""

    at: float  # monotonic seconds
    router: str
    status: int  # 0: no HTTP answer
    error: str | None  # the refusal's code, when it is one
    worker: str | None
    problem: str | None  # why it breaks the contract, judged when it came
    misrouted: bool = False  # served or refused by a worker that does not hold it
    took_s: float = 0.0

    @property
    def code(self) -> tuple[int, str | None]:
        return self.status, self.error


@dataclass(slots=True)
class TrackedEpisode:
    """An episode, the worker and router it was created on, and every answer it got."""

    key: str
    token: str
    router: str
    worker: str
    counter: int = 0
    calls: int = 0
    answers: list[Answer] = field(default_factory=list)

    @property
    def gone(self) -> bool:
        """Answered 410 once: it must never be served again."""
        return any(a.status == 410 for a in self.answers)

    def first(self, code: tuple[int, str | None]) -> Answer | None:
        return next((a for a in self.answers if a.code == code), None)

    def codes(self, since: float = 0.0) -> Counter[tuple[int, str | None]]:
        return Counter(a.code for a in self.answers if a.at >= since)


class FleetClient:
    """Requests to a router picked at random among those in service, every answer
    recorded and judged (see the module docstring)."""

    def __init__(self, fleet: Fleet, http: aiohttp.ClientSession, seed: int = 0) -> None:
        self.fleet = fleet
        self.http = http
        self.random = random.Random(seed)
        self.episodes: list[TrackedEpisode] = []

    def pick(self) -> FleetRouter:
        return self.random.choice(self.fleet.in_service())

    async def create(self, router: FleetRouter | None = None) -> TrackedEpisode:
        """POST /episodes on `router` (default: a random one): its worker holds it."""
        router = router or self.pick()
        async with self.http.post(f"{router.base_url}/episodes", json={}) as reply:
            body = await reply.json(content_type=None)
            assert reply.status == 200, f"POST /episodes on {router.router_id}: {body}"
        episode = TrackedEpisode(body["episode"], body["token"], router.router_id, body["worker"])
        self.episodes.append(episode)
        return episode

    async def create_many(self, count: int) -> list[TrackedEpisode]:
        return [await self.create() for _ in range(count)]

    async def call(self, episode: TrackedEpisode, router: FleetRouter | None = None) -> Answer:
        """`add 1` for `episode` on `router` (default: a random one), judged and recorded."""
        router = router or self.pick()
        status, body = 0, None
        sent_at = time.monotonic()
        try:
            async with self.http.post(
                f"{router.base_url}/tools/add",
                json={"value": 1},
                headers={TOKEN_HEADER: episode.token},
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as reply:
                status, raw = reply.status, await reply.read()
            with contextlib.suppress(ValueError):
                body = json.loads(raw)
        except (aiohttp.ClientError, TimeoutError):
            pass
        answer = self._judge(episode, router.router_id, status, body, sent_at)
        episode.answers.append(answer)
        return answer

    def _judge(
        self, episode: TrackedEpisode, router: str, status: int, body: Any, sent_at: float
    ) -> Answer:
        data = body if isinstance(body, dict) else {}
        error, worker = data.get("error"), data.get("worker")
        problem, misrouted = None, False
        if status == 200:
            if episode.gone:
                problem = "a 200 after a 410"
            expected = {
                "worker": episode.worker,
                "episode": episode.key,
                "result": episode.counter + 1,
                "calls": episode.calls + 1,
            }
            if data != expected:
                problem = f"expected {expected}, got {data}"
            episode.counter, episode.calls = episode.counter + 1, episode.calls + 1
            misrouted = data.get("worker") != episode.worker or data.get("episode") != episode.key
        elif status == 401:
            problem = "a 401 for a live episode"
        elif worker is not None and (worker != episode.worker or error == "unknown_episode"):
            # Every router's workers are w0 and w1: a worker's own "no such episode" is
            # how one that does not hold it shows, whatever its name.
            problem, misrouted = f"refused by another worker: {data}", True
        if problem is not None:
            problem = f"{episode.key} of {episode.router}/{episode.worker} via {router}: {problem}"
        now = time.monotonic()
        return Answer(now, router, status, error, worker, problem, misrouted, now - sent_at)

    async def round(self, episodes: Iterable[TrackedEpisode] | None = None) -> None:
        """One call of every episode (all at once, each on a random router)."""
        await asyncio.gather(*(self.call(e) for e in (episodes or self.episodes)))

    def problems(self) -> list[str]:
        return [a.problem for e in self.episodes for a in e.answers if a.problem is not None]

    def of(self, router_id: str) -> list[TrackedEpisode]:
        return [e for e in self.episodes if e.router == router_id]

    def not_of(self, router_id: str) -> list[TrackedEpisode]:
        return [e for e in self.episodes if e.router != router_id]

    def summary(self, title: str) -> str:
        """Answers by code, per creating router: the short print of each test."""
        lines = [title]
        for router_id in sorted({e.router for e in self.episodes}):
            codes: Counter[tuple[int, str | None]] = Counter()
            for episode in self.of(router_id):
                codes.update(episode.codes())
            shown = ", ".join(
                f"{s} {e or ''}".strip() + f": {n}"
                for (s, e), n in sorted(
                    codes.items(), key=lambda item: (item[0][0], item[0][1] or "")
                )
            )
            lines.append(f"  episodes of {router_id} ({len(self.of(router_id))}): {shown}")
        return "\n".join(lines)


def unexpected(
    episodes: Iterable[TrackedEpisode], allowed: Iterable[tuple[int, str | None]]
) -> list[str]:
    """Every non-200 answer of `episodes` outside `allowed`, described."""
    allowed_codes = set(allowed)
    return [
        f"{e.key} of {e.router} via {a.router}: {a.status} {a.error}"
        for e in episodes
        for a in e.answers
        if a.status != 200 and a.code not in allowed_codes
    ]
