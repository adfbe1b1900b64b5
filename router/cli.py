"""The `episode-router` command: run, check-config, demo, status, token mint."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import json
import os
import shlex
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from router.build import build_name
from router.config import (
    AdminConfig,
    Config,
    ConfigError,
    ControlConfig,
    ListenConfig,
    SpawnConfig,
    config_warnings,
    default_config,
    load_config,
)
from router.service import setup_logging
from router.tokens import SigningKey, mint_token, new_nonce


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command: str | None = args.command
    if command is None:
        parser.print_help()
        return 2
    handler = _COMMANDS[command]
    return handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="episode-router",
        description="Routes each episode's requests to the worker process that holds it.",
    )
    try:
        version = importlib.metadata.version("episode-router")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        version = "unknown"
    parser.add_argument(
        "--version", action="version", version=f"episode-router {version} ({build_name()})"
    )
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the router")
    run.add_argument("--config", required=True, help="YAML config file")
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("file")
    demo = sub.add_parser("demo", help="the router in front of demo workers, no config needed")
    demo.add_argument("--workers", type=int, default=4, help="demo worker processes (default 4)")
    demo.add_argument("--port", type=int, default=8080, help="public port (default 8080)")
    demo.add_argument("--admin-port", type=int, default=9901, help="admin port (default 9901)")
    demo.add_argument(
        "--base-port", type=int, default=19001, help="first worker port (default 19001)"
    )
    status = sub.add_parser("status", help="workers and claims, from the admin API")
    status.add_argument("--admin", default="http://127.0.0.1:9901", help="admin base URL")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--token-env",
        default=None,
        help="variable holding the admin bearer token (needed when admin is off loopback)",
    )
    token = sub.add_parser("token", help="episode token tools")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    mint = token_sub.add_parser("mint", help="mint an HS256 episode token")
    mint.add_argument("--ep", required=True)
    mint.add_argument("--att", type=int, default=0)
    mint.add_argument("--nonce", default=None, help="default: random")
    mint.add_argument(
        "--secret-env",
        default="EPISODE_TOKEN_SECRET",
        help="variable holding the HS256 key (default EPISODE_TOKEN_SECRET; unset: a random "
        "key, for a token whose signature nothing checks)",
    )
    mint.add_argument("--ttl", type=int, default=None, help="seconds until it expires")
    return parser


def _run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"episode-router: {exc}", file=sys.stderr)
        return 2
    return serve(config, config_path=args.config)


def serve(config: Config, banner: str | None = None, config_path: str | None = None) -> int:
    """Run the router with `config` until SIGTERM or SIGINT."""
    from router.service import RouterService, run_until_signalled

    setup_logging(config.log)
    _install_uvloop()
    service = RouterService(config, config_path=config_path)

    async def _main() -> None:
        if banner is not None:
            print(banner, flush=True)
        await run_until_signalled(service)

    try:
        asyncio.run(_main())
    except OSError as exc:
        print(f"episode-router: {exc}", file=sys.stderr)
        return 1
    return 0


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; the stdlib loop still works
        return
    uvloop.install()


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(f"episode-router: {exc}", file=sys.stderr)
        return 2
    kinds = ", ".join(kind.name for kind in config.sessions)
    print(f"{args.file}: ok (listen {config.listen.host}:{config.listen.port}; kinds: {kinds})")
    for warning in config_warnings(config):
        print(f"warning: {warning}")
    return 0


def demo_config(workers: int, port: int, admin_port: int, base_port: int, socket: str) -> Config:
    """The demo: the router spawns `workers` demo environment servers."""
    command = (
        f"{shlex.quote(sys.executable)} -m router.demo --port {{port}} --worker-id {{worker_id}}"
    )
    base = default_config()
    return dataclasses.replace(
        base,
        listen=ListenConfig(host="127.0.0.1", port=port),
        admin=AdminConfig(host="127.0.0.1", port=admin_port),
        control=dataclasses.replace(ControlConfig(), socket=f"unix:{socket}"),
        spawn=SpawnConfig(command=command, count=workers, base_port=base_port),
        log=dataclasses.replace(base.log, format="plain"),
    )


def _demo(args: argparse.Namespace) -> int:
    # The folder holds only the control socket, which the router removes as it stops.
    with tempfile.TemporaryDirectory(prefix="episode-router-demo-") as folder:
        socket = os.path.join(folder, "control.sock")
        config = demo_config(args.workers, args.port, args.admin_port, args.base_port, socket)
        return serve(config, banner=demo_banner(args.port, args.admin_port, args.workers))


def demo_banner(port: int, admin_port: int, workers: int) -> str:
    """The copy-paste lines `demo` prints: routing, 410 and 401."""
    base = f"http://127.0.0.1:{port}"
    admin = f"http://127.0.0.1:{admin_port}"
    cli = f"{shlex.quote(sys.executable)} -m router.cli"
    header = '-H "X-NeMo-Gym-Episode-Token: $TOKEN"'
    read_token = "python3 -c 'import json,sys; print(json.load(sys.stdin)[\"token\"])'"
    lines = [
        f"episode-router demo: {workers} demo workers behind {base} (admin {admin})",
        "",
        "Start an episode (the worker that answers claims it and hands out its token):",
        f"  TOKEN=$(curl -s -X POST {base}/episodes | {read_token})",
        'Every call with that token reaches the same worker (see "worker" and "calls"):',
        f"  curl -s -X POST {header} -d '{{\"value\": 5}}' {base}/tools/add",
        f"  curl -s -X POST {header} {base}/tools/get",
        "End it; the next call gets 410 episode_ended:",
        f"  curl -s -X POST {header} {base}/episodes/end",
        f"  curl -s -i -X POST {header} {base}/tools/get",
        "A token no worker ever claimed gets 401 unknown_episode:",
        f'  curl -s -i -X POST -H "X-NeMo-Gym-Episode-Token: $({cli} token mint --ep nobody)" '
        f"{base}/tools/get",
        f"The same tools over MCP: {base}/mcp, with the token header on every request",
        "  (docs/guides/mcp.md has a Python SDK client).",
        "Workers, their pids and claims (kill -9 one: its episodes get 410 worker_exited):",
        f"  {cli} status --admin {admin}",
        "Stop with Ctrl-C.",
    ]
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    url = args.admin.rstrip("/") + "/admin/workers"
    request = urllib.request.Request(url)
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            print(f"episode-router: {args.token_env} is not set", file=sys.stderr)
            return 2
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            data = json.load(reply)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"episode-router: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    fleet = _read_fleet(request, args.admin.rstrip("/") + "/admin/routers")
    if fleet is not None:
        data["routers"] = fleet
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_status(data["workers"]))
    if fleet is not None:
        print()
        print(format_fleet(fleet))
    for kind, misses in sorted(data.get("learn_misses", {}).items()):
        print(
            f"warning: {misses} seed repl{'y' if misses == 1 else 'ies'} named no session "
            f"where kind {kind!r} looks for one: check its seed's learn (the server's cookie "
            "name, header or JSON pointer)"
        )
    return 0


def _read_fleet(workers_request: urllib.request.Request, url: str) -> dict[str, Any] | None:
    """`/admin/routers`, or None for a router without a directory (404) or one whose
    answer cannot be read (the workers' table is shown all the same)."""
    request = urllib.request.Request(url, headers=dict(workers_request.header_items()))
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            found: dict[str, Any] = json.load(reply)
            return found
    except urllib.error.HTTPError as error:
        if error.code == 503:  # the directory did not answer: what the router knows
            unreachable: dict[str, Any] = json.load(error)
            return unreachable
        return None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def format_status(workers: list[dict[str, object]]) -> str:
    columns = ("id", "state", "draining", "claims", "in_flight", "pid", "url")
    return _table(columns, [tuple(str(w.get(c, "")) for c in columns) for w in workers])


def format_fleet(fleet: dict[str, Any]) -> str:
    """This router's place in the fleet, then every router the directory lists."""
    head = (
        f"fleet: this router {fleet.get('router_id')} epoch {fleet.get('epoch')} "
        f"({'registered' if fleet.get('registered') else 'not registered'}), "
        f"peer {fleet.get('peer')}"
    )
    if "members" not in fleet:
        return f"{head}\ndirectory unreachable: {fleet.get('detail', '')}"
    columns = ("router_id", "epoch", "alive", "peer", "lease_deadline_ms")
    members = fleet["members"]
    return (
        head + "\n" + _table(columns, [tuple(str(m.get(c, "")) for c in columns) for m in members])
    )


def _table(columns: tuple[str, ...], cells: list[tuple[str, ...]]) -> str:
    rows = [columns, *cells]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _token(args: argparse.Namespace) -> int:
    secret = os.environ.get(args.secret_env)
    if not secret:
        print(
            f"episode-router: {args.secret_env} is not set: signed with a random key, so "
            "a router or worker that verifies signatures refuses this token",
            file=sys.stderr,
        )
    key = SigningKey.hs256(secret.encode()) if secret else SigningKey.generate("HS256")
    now = int(time.time())
    exp = now + args.ttl if args.ttl else None
    try:
        token = mint_token(
            ep=args.ep, att=args.att, nonce=args.nonce or new_nonce(), key=key, iat=now, exp=exp
        )
    except ValueError as exc:
        print(f"episode-router: {exc}", file=sys.stderr)
        return 2
    print(token)
    return 0


_COMMANDS = {
    "run": _run,
    "check-config": _check_config,
    "demo": _demo,
    "status": _status,
    "token": _token,
}


if __name__ == "__main__":
    sys.exit(main())
