"""Operating the router end to end, on real processes: metrics, drains and reloads.

- A real Prometheus server scrapes the admin listener every second while
  episodes run; its query API must show the requests by outcome, the claims,
  the live workers, a latency quantile and the target up.
- A rolling restart of one worker: drained through the admin API, it gets no
  new episode while its own go on and end; stopped, none of its ended episodes
  turns into `worker_exited`, and the other workers never notice.
- SIGHUP: a changed limit applies to the next request; a broken file is refused
  with a log line and the running config stays.

Prometheus is Debian's `prometheus` package (CI installs it); without it the
first test fails, it never skips.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.launch import free_port
from router.tokens import SigningKey, mint_token, new_nonce

from .conftest import (
    LOOPBACK,
    START_TIMEOUT_S,
    Episode,
    Http,
    Launcher,
    Process,
    Reply,
    Router,
    add,
    assert_router_answer,
    call_tool,
    get,
    get_json,
    served_problem,
    start_episode,
    wait_until,
)

pytestmark = pytest.mark.e2e

T = TypeVar("T")

PROMETHEUS_FALLBACK = "/usr/bin/prometheus"  # where Debian's `prometheus` package puts it
JOB = "episode-router"
SCRAPE_INTERVAL_S = 1
SETTLE_S = 15.0  # a few scrape intervals, with room for a busy 2-core machine
EPISODES = 20
UNKNOWN_TOKENS = 3
CONCURRENCY = 8
STRANGER_KEY = SigningKey.generate("HS256")  # no worker ever minted with it

# --- Prometheus ---------------------------------------------------------------------------------


def prometheus_binary() -> str:
    """The prometheus executable; the test fails (never skips) when it is not installed."""
    found = shutil.which("prometheus")
    if found is None and os.access(PROMETHEUS_FALLBACK, os.X_OK):
        found = PROMETHEUS_FALLBACK
    if found is None:
        pytest.fail(
            "prometheus is not installed: this test runs a real Prometheus server. "
            "Install Debian's `prometheus` package (`apt-get install prometheus`; "
            "the CI script does it before the test command).",
            pytrace=False,
        )
    return found


@dataclass(frozen=True, slots=True)
class Prometheus:
    """A Prometheus server this test started, scraping one router's admin listener."""

    url: str
    process: Process

    def api(self, path: str, **params: str) -> Any:
        """The `data` of a successful API reply; AssertionError for anything else."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        reply = get_json(f"{self.url}/api/v1/{path}{query}", timeout=5.0)
        assert reply is not None, f"Prometheus at {self.url} is unreachable\n{self.process.tail()}"
        status, body = reply
        assert status == 200 and isinstance(body, dict), f"{path} {params}: {status} {body}"
        assert body.get("status") == "success", body
        return body["data"]

    def vector(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant query's samples: (labels, value)."""
        data = self.api("query", query=promql)
        assert data["resultType"] == "vector", data
        return [(sample["metric"], float(sample["value"][1])) for sample in data["result"]]

    def by_label(self, promql: str, label: str) -> dict[str, float]:
        """An instant query's nonzero samples, by the value of one label."""
        return {labels[label]: value for labels, value in self.vector(promql) if value != 0}

    def scalar(self, promql: str) -> float | None:
        """The value of a query that gives one sample (None when it gives none)."""
        samples = self.vector(promql)
        assert len(samples) <= 1, f"{promql} gave several samples: {samples}"
        return samples[0][1] if samples else None

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return active


def start_prometheus(binary: str, launcher: Launcher, router: Router) -> Prometheus:
    """A Prometheus server scraping `router`'s admin listener every second (not waited for)."""
    folder = launcher.root / "prometheus"
    folder.mkdir()
    config = {
        "global": {
            "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
            "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
            "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        },
        "scrape_configs": [
            {
                "job_name": JOB,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [f"{LOOPBACK}:{router.admin_port}"]}],
            }
        ],
    }
    config_path = folder / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address={LOOPBACK}:{port}",
        "--web.enable-lifecycle",
        "--log.level=warn",
    ]
    return Prometheus(f"http://{LOOPBACK}:{port}", launcher.start("prometheus", argv))


def wait_target_up(prometheus: Prometheus, router: Router) -> None:
    """Until Prometheus has scraped the router's admin listener successfully."""
    instance = f"{LOOPBACK}:{router.admin_port}"

    def up() -> bool:
        ready = get_json(f"{prometheus.url}/-/ready")  # 503 while its storage opens
        if ready is None or ready[0] != 200:
            return False
        return [(t["labels"]["instance"], t["health"]) for t in prometheus.targets()] == [
            (instance, "up")
        ]

    wait_until(f"Prometheus to scrape {instance}", up, START_TIMEOUT_S, watch=prometheus.process)


def settled(read: Callable[[], T], done: Callable[[T], bool]) -> T:
    """Poll `read` until `done` holds for its value (the next scrapes have landed);
    the last value either way, so the caller's assertion shows what Prometheus saw."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        value = read()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(0.2)


async def run_episode(http: Http, base_url: str, index: int, gate: asyncio.Semaphore) -> Episode:
    """Start an episode and make five calls on it, each served by its own worker."""
    async with gate:
        episode = await start_episode(http, base_url, ep=f"scraped-{index}")
        await add(http, base_url, episode, index)
        await add(http, base_url, episode, 1000)
        await get(http, base_url, episode)
        args = {"episode": index}
        problem = served_problem(
            await call_tool(http, base_url, episode, "echo", args), episode, args
        )
        assert problem is None, problem
        await get(http, base_url, episode)
        return episode


async def test_prometheus_scrapes_the_router_and_sees_the_traffic(
    launcher: Launcher, http: Http
) -> None:
    binary = prometheus_binary()  # before anything starts: a missing one fails at once
    router = launcher.router()
    prometheus = start_prometheus(binary, launcher, router)  # starts while the workers do
    launcher.workers(router, ["w1", "w2"])
    router.wait_ready(recovered=True)  # unknown tokens get 401, not 503 recovering
    wait_target_up(prometheus, router)

    gate = asyncio.Semaphore(CONCURRENCY)
    episodes = await asyncio.gather(
        *(run_episode(http, router.base_url, index, gate) for index in range(EPISODES))
    )
    for index in range(UNKNOWN_TOKENS):
        stranger = mint_token(
            ep=f"stranger-{index}", att=0, nonce=new_nonce(), key=STRANGER_KEY, iat=0
        )
        reply = await http.post(f"{router.base_url}/tools/get", token=stranger)
        assert_router_answer(reply, 401, "unknown_episode", f"stranger-{index}-a0")
    ended = episodes[0]
    reply = await http.post(f"{router.base_url}/episodes/end", token=ended.token)
    assert reply.status == 200, str(reply)
    reply = await call_tool(http, router.base_url, ended, "get", None)
    assert_router_answer(reply, 410, "episode_ended", ended.key)

    # Every request so far: 20 starts (no session), 100 calls and one end (forwarded),
    # 3 strangers (401) and one call after the end (410).
    by_outcome = "sum by (outcome) (episode_router_requests_total)"
    expected = {
        "forwarded": EPISODES * 6 + 1,
        "unknown_episode": UNKNOWN_TOKENS,
        "episode_ended": 1,
    }
    seen = settled(lambda: prometheus.by_label(by_outcome, "outcome"), expected.__eq__)
    assert seen == expected, f"{by_outcome}: {seen}"
    forwarded = 'sum by (kind) (episode_router_requests_total{outcome="forwarded"})'
    assert prometheus.by_label(forwarded, "kind") == {"none": EPISODES, "episode": EPISODES * 5 + 1}
    live_episodes = EPISODES - 1
    assert prometheus.scalar("sum(episode_router_claims)") == live_episodes
    per_worker = prometheus.by_label("sum by (worker) (episode_router_claims)", "worker")
    assert per_worker == dict(Counter(e.worker for e in episodes[1:]))
    assert prometheus.scalar('episode_router_workers{state="live"}') == 2
    assert prometheus.scalar(f'up{{job="{JOB}"}}') == 1

    median = (
        "histogram_quantile(0.5, sum by (le) "
        "(rate(episode_router_request_duration_seconds_bucket[1m])))"
    )
    value = settled(lambda: prometheus.scalar(median), lambda v: v is not None and math.isfinite(v))
    assert value is not None and math.isfinite(value), f"{median} gave {value}"
    assert 0 < value <= 1.0, f"median request duration {value} s on loopback"


# --- drain --------------------------------------------------------------------------------------


async def metric_samples(http: Http, router: Router) -> dict[tuple[str, frozenset[Any]], float]:
    """GET /metrics (the text format), every sample by (name, labels)."""
    reply = await http.request("GET", f"{router.admin_url}/metrics")
    assert reply.status == 200, str(reply)
    assert reply.headers["Content-Type"].startswith("text/plain"), reply.headers
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(reply.body.decode())
        for sample in family.samples
    }


def drain_gauges(samples: Mapping[tuple[str, frozenset[Any]], float]) -> dict[str, float]:
    """episode_router_workers_draining and each worker's episode_router_worker_draining."""
    found = {"all": samples[("episode_router_workers_draining", frozenset())]}
    for worker in ("w1", "w2", "w3"):
        labels = frozenset({("worker", worker)})
        found[worker] = samples[("episode_router_worker_draining", labels)]
    return found


def views(router: Router) -> dict[str, tuple[str, bool, int]]:
    """(state, draining, claims) of every worker, from GET /admin/workers."""
    return {
        worker_id: (view["state"], view["draining"], view["claims"])
        for worker_id, view in router.workers().items()
    }


def assert_ready(router: Router) -> None:
    reply = router.admin("/readyz")
    assert reply is not None and reply[0] == 200, reply
    assert (reply[1]["ready"], reply[1]["recovering"]) == (True, False), reply


async def test_drained_worker_takes_no_new_episode_and_stops_cleanly(
    launcher: Launcher, http: Http
) -> None:
    router = launcher.router()
    workers = {w.worker_id: w for w in launcher.workers(router, ["w1", "w2", "w3"])}
    router.wait_ready(recovered=True)
    first = [await start_episode(http, router.base_url) for _ in range(9)]
    assert Counter(e.worker for e in first) == {"w1": 3, "w2": 3, "w3": 3}  # fewest claims
    for value, episode in enumerate(first, start=1):
        await add(http, router.base_url, episode, value)
    assert drain_gauges(await metric_samples(http, router)) == dict.fromkeys(
        ("all", "w1", "w2", "w3"), 0.0
    )

    reply = await http.request("POST", f"{router.admin_url}/admin/workers/w2/drain")
    assert reply.status == 200, str(reply)
    body = reply.json()
    assert body["ok"] is True
    shown = {k: body["worker"][k] for k in ("id", "state", "draining", "claims")}
    assert shown == {"id": "w2", "state": "live", "draining": True, "claims": 3}
    assert drain_gauges(await metric_samples(http, router)) == {
        **dict.fromkeys(("all", "w2"), 1.0),
        **dict.fromkeys(("w1", "w3"), 0.0),
    }
    assert_ready(router)

    fresh = [await start_episode(http, router.base_url) for _ in range(30)]
    assert Counter(e.worker for e in fresh) == {"w1": 15, "w3": 15}, "an episode went to w2"
    drained = [e for e in first if e.worker == "w2"]
    others = [e for e in first if e.worker != "w2"] + fresh
    for episode in drained:  # its running episodes go on, on w2
        await add(http, router.base_url, episode, 100)
        await get(http, router.base_url, episode)
    for episode in drained:
        reply = await http.post(f"{router.base_url}/episodes/end", token=episode.token)
        assert (reply.status, reply.json()["result"]) == (
            200,
            {"ended": True, "counter": episode.counter},
        ), str(reply)
    assert views(router) == {
        "w1": ("live", False, 18),
        "w2": ("live", True, 0),
        "w3": ("live", False, 18),
    }
    assert drain_gauges(await metric_samples(http, router))["all"] == 1.0

    w2 = workers["w2"].process
    w2.signal(signal.SIGTERM)  # it says bye on its way out
    assert await asyncio.to_thread(w2.wait, 10.0) == 0, w2.tail()
    wait_until("w2 to be exited", lambda: views(router)["w2"][0] == "exited", 5.0)
    assert views(router) == {
        "w1": ("live", False, 18),
        "w2": ("exited", True, 0),  # an operator's drain outlives the process
        "w3": ("live", False, 18),
    }
    for episode in drained:  # ended before the stop: still episode_ended, never worker_exited
        reply = await call_tool(http, router.base_url, episode, "get", None)
        assert_router_answer(reply, 410, "episode_ended", episode.key)
        session = router.admin(f"/admin/sessions/episode/{episode.key}")
        assert session is not None and session[0] == 200, session
        assert (session[1]["worker"], session[1]["state"]) == ("w2", "episode_ended")
    for episode in others:  # the other workers' episodes carry on
        await add(http, router.base_url, episode, 7)
        await get(http, router.base_url, episode)
    assert_ready(router)
    samples = await metric_samples(http, router)
    states = {
        state: samples[("episode_router_workers", frozenset({("state", state)}))]
        for state in ("live", "unhealthy", "lost", "exited")
    }
    assert states == {"live": 2.0, "unhealthy": 0.0, "lost": 0.0, "exited": 1.0}


# --- reload -------------------------------------------------------------------------------------


def log_lines(process: Process, message: str) -> list[dict[str, Any]]:
    """The JSON log lines of `process` whose message contains `message`."""
    found = []
    for line in process.stderr_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and message in str(record.get("msg", "")):
            found.append(record)
    return found


def rewrite_and_hup(router: Router, text: str, message: str) -> dict[str, Any]:
    """Write `text` as the router's config file, SIGHUP it, and wait for its next log line
    containing `message`; that line."""
    before = len(log_lines(router.process, message))
    router.config_path.write_text(text)
    router.process.signal(signal.SIGHUP)
    wait_until(
        f"a log line with {message!r}",
        lambda: len(log_lines(router.process, message)) > before,
        5.0,
        watch=router.process,
    )
    return log_lines(router.process, message)[-1]


async def echo(http: Http, router: Router, episode: Episode, size: int) -> tuple[Reply, str | None]:
    """An `echo` call whose JSON body is `size` bytes long: the reply, and why it is not the
    episode's worker echoing the arguments back (None when it is)."""
    args = {"pad": "x" * (size - len('{"pad": ""}'))}
    assert len(json.dumps(args)) == size
    reply = await call_tool(http, router.base_url, episode, "echo", args)
    return reply, served_problem(reply, episode, args)


async def test_sighup_applies_a_new_limit_and_refuses_a_broken_file(
    launcher: Launcher, http: Http
) -> None:
    router = launcher.router()
    launcher.workers(router, ["w1"])
    episode = await start_episode(http, router.base_url)
    _, problem = await echo(http, router, episode, 4000)
    assert problem is None, problem  # no body limit yet

    config = {**router.config, "limits": {"max_body_bytes": 1024}}
    reloaded = rewrite_and_hup(router, yaml.safe_dump(config), "config reloaded")
    assert (reloaded["applied"], reloaded["needs_restart"]) == (["limits"], [])
    reply, _ = await echo(http, router, episode, 4000)
    assert_router_answer(reply, 413, "payload_too_large", None)
    _, problem = await echo(http, router, episode, 1000)
    assert problem is None, problem  # under the new limit

    broken = yaml.safe_dump({**router.config, "limits": {"max_body_bytes": "big"}})
    refused = rewrite_and_hup(router, broken, "config reload refused")
    assert refused["level"] == "error"
    assert "limits.max_body_bytes" in refused["reason"], refused
    assert router.process.returncode is None
    _, problem = await echo(http, router, episode, 1000)
    assert problem is None, problem  # still serving
    reply, _ = await echo(http, router, episode, 4000)
    assert_router_answer(reply, 413, "payload_too_large", None)  # the running limit stays
    await get(http, router.base_url, episode)
    assert views(router) == {"w1": ("live", False, 1)}
