"""The admin listener (design §6): health, readiness, and read-only views of the state.

Separate from the public port and on loopback by default. Boot ids are never
shown. Reads the core; changes nothing but a worker's drain flag (and reloads).

A browser on the host must not be a way in: a request whose `Host` is not the
listener's own address (or `localhost` on a loopback or wildcard bind, or a name in
`admin.allowed_hosts`) is 421 `misdirected_host`, which defeats DNS rebinding; a
state-changing request from another origin (`Origin` not the request's own,
`Sec-Fetch-Site` other than same-origin or none) is 403 `cross_origin`, which
defeats a page that posts a form. `host_allowed` and `cross_origin` are pure.
"""

from __future__ import annotations

import hmac
import time
from typing import Any, Protocol

from aiohttp import web

from router.config import Config, ConfigError
from router.core import RouterCore, Worker, WorkerState
from router.directory import DirectoryError
from router.fleet import FleetLink
from router.metrics import RouterMetrics
from router.protocol import is_ip, is_loopback_host, split_host_port
from router.service.reload import ReloadPlan


class AdminBackend(Protocol):
    """What the admin API reads and changes of a running router (its `RouterService`):
    the config it runs, its core, its metrics, its spawned workers' pids and its reload."""

    @property
    def config(self) -> Config: ...
    @property
    def core(self) -> RouterCore: ...
    @property
    def metrics(self) -> RouterMetrics: ...
    @property
    def fleet(self) -> FleetLink | None: ...
    def worker_pid(self, worker_id: str) -> int | None: ...
    async def reload_from_file(self) -> ReloadPlan: ...


_SERVICE: web.AppKey[AdminBackend] = web.AppKey("service")
_OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_WILDCARDS = frozenset({"0.0.0.0", "::"})
# What a browser says of a request its user (or no page) started: anything else came
# from a page of another origin (`same-site` too: another port of localhost is one).
_OWN_FETCH_SITES = frozenset({"same-origin", "none"})


def admin_application(service: AdminBackend) -> web.Application:
    app = web.Application(middlewares=[_refuse_browser_tricks, _require_token])
    app[_SERVICE] = service
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/workers", _workers)
    app.router.add_get("/admin/routers", _routers)
    app.router.add_get("/admin/sessions/{kind}/{key}", _session)
    app.router.add_post("/admin/reload", _reload)
    app.router.add_post("/admin/workers/{id}/drain", _drain)
    app.router.add_delete("/admin/workers/{id}/drain", _undrain)
    return app


def host_of(authority: str) -> str | None:
    """The host of a `Host` header or an origin's authority (`host[:port]`, `[v6][:port]`),
    lower-cased and unbracketed; None when it is not one."""
    text = authority.strip().lower()
    parsed = split_host_port(text)
    if parsed is not None:
        return parsed[0]
    if text.startswith("[") and text.endswith("]") and is_ip(text[1:-1]):
        return text[1:-1]
    return text if text and ":" not in text and split_host_port(f"{text}:1") else None


def host_allowed(host_header: str | None, bind_host: str, allowed_hosts: frozenset[str]) -> bool:
    """True when a request with `Host: host_header` may be answered by an admin listener
    bound to `bind_host`. The port is not compared: a port mapping (a container's)
    changes it, and a rebinding page can only choose the name."""
    if host_header is None:
        return True  # no browser sends a request without one
    host = host_of(host_header)
    if host is None:
        return False
    bind = bind_host.lower().strip("[]")
    if host in allowed_hosts or host == bind:
        return True
    if host == "localhost":
        return bind in _WILDCARDS or is_loopback_host(bind)
    # An address is not a name a page could rebind: a wildcard bind is every address of
    # the host, and a loopback one (`localhost` included) every loopback address.
    if not is_ip(host):
        return False
    return bind in _WILDCARDS or (is_loopback_host(bind) and is_loopback_host(host))


def cross_origin(method: str, host_header: str | None, headers: dict[str, str]) -> bool:
    """True for a state-changing request a page of another origin sent."""
    if method not in _STATE_CHANGING:
        return False
    site = headers.get("sec-fetch-site")
    if site is not None and site.lower() not in _OWN_FETCH_SITES:
        return True
    origin = headers.get("origin")
    if origin is None:
        return False  # not a browser's cross-origin request (it always sends one)
    scheme, sep, authority = origin.partition("://")
    own = host_header.strip().lower() if host_header is not None else None
    return not sep or scheme.lower() != "http" or authority.lower() != own


@web.middleware
async def _refuse_browser_tricks(request: web.Request, handler: Any) -> web.StreamResponse:
    """421 for a Host that is not this listener's, 403 for a cross-origin change.

    Off loopback, health and metrics are open to whoever reaches the port (a
    scraper naming the router's service): any Host is taken for them."""
    admin = request.app[_SERVICE].config.admin
    host_header = request.headers.get("Host")
    open_to_all = request.path in _OPEN_PATHS and not is_loopback_host(admin.host)
    if not open_to_all and not host_allowed(
        host_header, admin.host, frozenset(admin.allowed_hosts)
    ):
        detail = "This Host is not the admin listener's address (admin.allowed_hosts)."
        return web.json_response({"error": "misdirected_host", "detail": detail}, status=421)
    fetch = {k: request.headers[k] for k in ("origin", "sec-fetch-site") if k in request.headers}
    if cross_origin(request.method, host_header, fetch):
        detail = "A change from a page of another origin is refused."
        return web.json_response({"error": "cross_origin", "detail": detail}, status=403)
    response: web.StreamResponse = await handler(request)
    return response


@web.middleware
async def _require_token(request: web.Request, handler: Any) -> web.StreamResponse:
    """Off loopback, everything but health and metrics needs the bearer token."""
    service = request.app[_SERVICE]
    if request.path not in _OPEN_PATHS and not is_loopback_host(service.config.admin.host):
        token = service.config.admin.token or ""
        # Header bytes that are not UTF-8 arrive surrogate-escaped: turned back into the
        # bytes that were sent, they are simply a wrong token (401), not an encode error.
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, f"Bearer {token}".encode()):
            return web.json_response(
                {"error": "unauthorized", "detail": "A bearer token is required."}, status=401
            )
    response: web.StreamResponse = await handler(request)
    return response


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[_SERVICE].metrics.render(request.headers.get("Accept", ""))
    # The content type carries a charset and a version, which aiohttp's `content_type=`
    # refuses: pass it as a header.
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _readyz(request: web.Request) -> web.Response:
    core = request.app[_SERVICE].core
    recovering = core.recovering(time.monotonic())
    ready = recovering or core.workers.any_live()
    workers = list(core.workers)
    body = {
        "ready": ready,
        "recovering": recovering,
        "live_workers": sum(1 for w in workers if w.state is WorkerState.LIVE),
        "accepting_workers": sum(1 for w in workers if w.accepts_new_sessions),
    }
    return web.json_response(body, status=200 if ready else 503)


def worker_view(worker: Worker, held: int, pid: int | None = None) -> dict[str, Any]:
    """What the admin API shows of a worker (never its boot id). `pid` is known
    for workers the router spawned."""
    return {
        "id": worker.id,
        "url": worker.url,
        "state": worker.state.value,
        "origin": worker.origin.value,
        "draining": worker.draining,
        "generation": worker.generation,
        "claims": held,
        "in_flight": worker.in_flight,
        "pid": pid,
    }


async def _workers(request: web.Request) -> web.Response:
    service = request.app[_SERVICE]
    core = service.core
    views = [
        worker_view(w, core.claims.held_count(w.id), service.worker_pid(w.id))
        for w in sorted(core.workers, key=_by_id)
    ]
    # Seed replies that named no session, by kind: a kind whose config cannot learn.
    return web.json_response({"workers": views, "learn_misses": dict(core.learn_misses)})


async def _routers(request: web.Request) -> web.Response:
    """The fleet as the directory sees it (design §10): this router's incarnation and
    every router's current one, its lease and peer address, alive or not."""
    fleet = request.app[_SERVICE].fleet
    if fleet is None:
        return web.json_response(
            {"error": "no_directory", "detail": "This router has no `directory:` section."},
            status=404,
        )
    view: dict[str, Any] = {
        "router_id": fleet.router_id,
        "epoch": fleet.directory.epoch,
        "registered": fleet.registered,
        "peer": fleet.settings.peer_address,
    }
    try:
        members = await fleet.refresh_members()
    except DirectoryError as error:
        view["error"] = "directory_unavailable"
        view["detail"] = str(error)
        return web.json_response(view, status=503)
    now_ms = time.time() * 1000
    view["members"] = [
        {
            "router_id": member.router_id,
            "epoch": member.epoch,
            "lease_deadline_ms": member.lease_deadline_ms,
            "peer": member.peer,
            "alive": member.lease_deadline_ms > now_ms,
        }
        for member in members
    ]
    return web.json_response(view)


def _by_id(worker: Worker) -> str:
    return worker.id


async def _session(request: web.Request) -> web.Response:
    core = request.app[_SERVICE].core
    kind, key = request.match_info["kind"], request.match_info["key"]
    claim = core.session_info(kind, key)
    if claim is None:
        detail = "The router holds no claim and remembers no end for this session."
        body = {"error": "unknown_session", "detail": detail, "kind": kind, "key": key}
        return web.json_response(body, status=404)
    age = time.monotonic() - claim.since
    return web.json_response(
        {
            "kind": kind,
            "key": key,
            "worker": claim.worker,
            "state": claim.state.value,
            "age_s": round(age, 3),
            "learned": claim.learned,
        }
    )


async def _reload(request: web.Request) -> web.Response:
    """Reload the config file; a bad one is refused with its reason, the old one stays."""
    service = request.app[_SERVICE]
    try:
        plan = await service.reload_from_file()
    except LookupError as exc:
        return web.json_response({"error": "no_config_file", "detail": str(exc)}, status=409)
    except (ConfigError, ValueError) as exc:
        body = {"error": "invalid_config", "detail": f"{exc}; the running config stays."}
        return web.json_response(body, status=400)
    return web.json_response(
        {"ok": True, "applied": list(plan.applied), "needs_restart": list(plan.needs_restart)}
    )


async def _set_drain(request: web.Request, on: bool) -> web.Response:
    service = request.app[_SERVICE]
    core = service.core
    worker = core.workers.get(request.match_info["id"])
    if worker is None:
        detail = "No worker with this id is known (or it exited long ago)."
        return web.json_response({"error": "unknown_worker", "detail": detail}, status=404)
    core.set_draining(worker, on)
    view = worker_view(worker, core.claims.held_count(worker.id), service.worker_pid(worker.id))
    return web.json_response({"ok": True, "worker": view})


async def _drain(request: web.Request) -> web.Response:
    return await _set_drain(request, True)


async def _undrain(request: web.Request) -> web.Response:
    return await _set_drain(request, False)
