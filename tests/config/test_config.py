"""Tests for router.config: the parser is pure, so these run with no event loop and no sockets.

Bad files are table-driven: each row is a YAML text, the key path the error must name and a
fragment of its reason. Only `load_config` touches the disk, under `tmp_path`.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from textwrap import dedent
from typing import NamedTuple

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
)

from router.config import (
    AdminConfig,
    BodyFieldConfig,
    ClaimsConfig,
    Config,
    ConfigError,
    ControlConfig,
    CookieSourceConfig,
    HealthConfig,
    LearnConfig,
    LimitsConfig,
    ListenConfig,
    LogConfig,
    McpSourceConfig,
    PathSourceConfig,
    RouteConfig,
    SessionKindConfig,
    SignatureConfig,
    SpawnConfig,
    StateConfig,
    StaticWorkerConfig,
    TimeoutsConfig,
    TokenFormatConfig,
    VerifyConfig,
    default_config,
    is_tcp_socket,
    load_config,
    parse_config,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "router.example.yaml"
SOURCE = "router.yaml"
HS256_SECRET = "0123456789abcdef0123456789abcdef"  # 32 bytes, the RFC 7518 minimum
SHARED_SECRET = "control-secret-0123"
ADMIN_TOKEN = "admin-token-0123456789"

EPISODE = SessionKindConfig("episode", "X-NeMo-Gym-Episode-Token", TokenFormatConfig("jws"))
RESOURCES_COOKIE = "ResourcesServer___resources"
NEMO_GYM_COOKIE = "SimpleWeatherResourcesServer___single_tool"  # the example file's
MCP_POINTER = "/mcp/headers/X-NeMo-Gym-Session-Token"
ENV_MCP_POINTER = "/resources_tools/headers/X-NeMo-Gym-Session-Token"

# Every default written out literally, so a changed default fails here.
DEFAULTS = Config(
    listen=ListenConfig("0.0.0.0", 8080),
    admin=AdminConfig("127.0.0.1", 9901, None),
    control=ControlConfig("unix:/run/episode-router/control.sock", (), (), None, 15.0, 5.0),
    workers=(),
    health=HealthConfig("/health", 1.0, 1.0, 2),
    spawn=None,
    sessions=(SessionKindConfig("episode", "X-NeMo-Gym-Episode-Token", TokenFormatConfig()),),
    claims=ClaimsConfig(3600.0, 1_000_000, 30.0, 3600.0),
    state=StateConfig(None),
    limits=LimitsConfig(16384, 100, None, 10.0, 75.0, 8190),
    timeouts=TimeoutsConfig(2.0, 300.0, 300.0, 30.0),
    log=LogConfig("json", False, "info"),
)


def file_reader(files: Mapping[str, bytes]) -> Callable[[str], bytes]:
    """A read_file for parse_config: the given files exist, any other path does not."""

    def read(path: str) -> bytes:
        if path not in files:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return files[path]

    return read


def parse(
    text: str, env: Mapping[str, str] | None = None, files: Mapping[str, bytes] | None = None
) -> Config:
    read_file = None if files is None else file_reader(files)
    return parse_config(dedent(text), source=SOURCE, env=env, read_file=read_file)


def public_pem(alg: str) -> bytes:
    key = (
        ed25519.Ed25519PrivateKey.generate()
        if alg == "EdDSA"
        else ec.generate_private_key(ec.SECP256R1() if alg == "ES256" else ec.SECP384R1())
    )
    return key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)


def kind(token: str = "{}", extra: str = "") -> str:
    """A one-kind sessions list with the given token mapping."""
    return f"sessions: [{{name: e, header: X-T, token: {token}{extra}}}]"


def verify(body: str) -> str:
    return kind(f"{{verify: {{{body}}}}}")


VERIFY = "sessions[0].token.verify"


# ---------------------------------------------------------------------------- good files


def test_default_config_is_all_defaults() -> None:
    config = default_config()
    assert config == DEFAULTS
    assert config == Config()
    assert config.control.unix_path == "/run/episode-router/control.sock"
    assert config.control.tcp_address is None
    assert config.session_kind("episode") == EPISODE
    assert config.session_kind("resources") is None


@pytest.mark.parametrize(
    "text",
    ["", "\n\n", "# nothing but a comment\n", "---\n", "~\n", "sessions: null\n", "listen: {}\n"],
)
def test_empty_documents_and_sections_give_defaults(text: str) -> None:
    assert parse(text) == DEFAULTS


def test_omitted_sessions_give_the_episode_kind() -> None:
    config = parse("listen: {port: 8081}\n")
    assert config == dataclasses.replace(DEFAULTS, listen=ListenConfig("0.0.0.0", 8081))


def test_example_file_parses_to_its_documented_values() -> None:
    expected = dataclasses.replace(
        DEFAULTS,
        workers=(
            StaticWorkerConfig("s0", "http://127.0.0.1:9001"),
            StaticWorkerConfig("s1", "unix:/run/my-env-server/s1.sock"),
        ),
        spawn=SpawnConfig("python -m my_env_server --host {host} --port {port}", 2, 9101),
        sessions=(
            EPISODE,
            SessionKindConfig(
                "resources",
                cookie=CookieSourceConfig(NEMO_GYM_COOKIE, "starlette", "session_id"),
                seed=RouteConfig("POST", "/seed_session", (LearnConfig(cookie=NEMO_GYM_COOKIE),)),
                close=RouteConfig("POST", "/close_session"),
            ),
            SessionKindConfig(
                "mcp_token",
                "X-NeMo-Gym-Session-Token",
                TokenFormatConfig("itsdangerous", "sid"),
                seed=RouteConfig(
                    "POST",
                    "/seed_session",
                    (
                        LearnConfig(json_pointer=ENV_MCP_POINTER),
                        LearnConfig(json_pointer=MCP_POINTER),
                    ),
                ),
            ),
            SessionKindConfig("mcp_session", mcp=McpSourceConfig("/mcp", "Mcp-Session-Id")),
            SessionKindConfig(
                "chat_session", "X-Chat-Session", TokenFormatConfig("raw"), unclaimed="forward"
            ),
        ),
    )
    assert parse_config(EXAMPLE.read_text(encoding="utf-8"), source=str(EXAMPLE)) == expected
    assert load_config(EXAMPLE, env={}) == expected


def test_every_key_is_read() -> None:
    text = """
        listen: {host: "::", port: 0}
        admin: {host: 0.0.0.0, port: 0, token_file: /secrets/admin}
        control:
          socket: "tcp://[::1]:9902"
          allowed_upstreams: ["http://10.0.0.7:9001", "unix:/srv/w.sock"]
          secret_env: CONTROL_SECRET
          lease_timeout_s: 20
          reconnect_grace_s: 2.5
        workers: [{id: a.1, url: "http://[::1]:9001"}, {id: b_2, url: "http://localhost:9002"}]
        health: {path: "/ready?full=1", interval_s: 0.5, timeout_s: 0.25, failures: 5}
        spawn: {command: "srv --bind {host}:{port} --name {worker_id}", count: 256,
                base_port: 65280, host: 127.0.0.2, stop_timeout_s: 3}
        sessions:
          - name: episode
            header: x-nemo-gym-episode-token
            token: {format: jws, verify: {alg: HS256, secret_env: TOKEN_SECRET}}
            unclaimed: forward
          - {name: raw_1, header: X-Raw, token: {format: raw}}
        claims: {tombstone_ttl_s: 60, max_tombstones: 10, recovery_window_s: 1,
                 learned_idle_ttl_s: 7}
        state: {path: /var/lib/episode-router/journal}
        limits: {max_header_bytes: 1024, max_headers: 10, max_body_bytes: 1048576,
                 header_timeout_s: 1, idle_timeout_s: 2, max_line_bytes: 512}
        timeouts: {connect_s: 0.5, first_byte_s: 10, stream_idle_s: 20, shutdown_grace_s: 1}
        log: {format: plain, access: true, level: debug}
    """
    env = {"CONTROL_SECRET": SHARED_SECRET, "TOKEN_SECRET": HS256_SECRET}
    config = parse(text, env, {"/secrets/admin": ADMIN_TOKEN.encode() + b"\n"})
    assert config == Config(
        listen=ListenConfig("::", 0),
        admin=AdminConfig("0.0.0.0", 0, ADMIN_TOKEN),
        control=ControlConfig(
            "tcp://[::1]:9902",
            (),
            ("http://10.0.0.7:9001", "unix:/srv/w.sock"),
            SHARED_SECRET,
            20.0,
            2.5,
        ),
        workers=(
            StaticWorkerConfig("a.1", "http://[::1]:9001"),
            StaticWorkerConfig("b_2", "http://localhost:9002"),
        ),
        health=HealthConfig("/ready?full=1", 0.5, 0.25, 5),
        spawn=SpawnConfig(
            "srv --bind {host}:{port} --name {worker_id}", 256, 65280, "127.0.0.2", 3.0
        ),
        sessions=(
            SessionKindConfig(
                "episode",
                "x-nemo-gym-episode-token",
                TokenFormatConfig("jws", None, VerifyConfig("HS256", HS256_SECRET.encode())),
                unclaimed="forward",
            ),
            SessionKindConfig("raw_1", "X-Raw", TokenFormatConfig("raw"), unclaimed="reject"),
        ),
        claims=ClaimsConfig(60.0, 10, 1.0, 7.0),
        state=StateConfig("/var/lib/episode-router/journal"),
        limits=LimitsConfig(1024, 10, 1048576, 1.0, 2.0, 512),
        timeouts=TimeoutsConfig(0.5, 10.0, 20.0, 1.0),
        log=LogConfig("plain", True, "debug"),
    )
    assert config.control.tcp_address == ("::1", 9902)
    assert config.control.unix_path is None
    assert type(config.control.lease_timeout_s) is float


def test_control_socket_forms() -> None:
    env = {"S": SHARED_SECRET}
    tcp = parse("control: {socket: 'tcp://localhost:9902', secret_env: S}", env).control
    assert (tcp.tcp_address, tcp.unix_path, tcp.secret) == (
        ("localhost", 9902),
        None,
        SHARED_SECRET,
    )
    relative = parse("control: {socket: 'unix:run/control.sock', allowed_uids: [0, 1000]}").control
    assert (relative.unix_path, relative.tcp_address) == ("run/control.sock", None)
    assert relative.allowed_uids == (0, 1000)
    assert (is_tcp_socket(tcp.socket), is_tcp_socket(relative.socket)) == (True, False)


@pytest.mark.parametrize(
    ("content", "secret"),
    [
        (HS256_SECRET.encode(), HS256_SECRET.encode()),
        (HS256_SECRET.encode() + b"\n", HS256_SECRET.encode()),
        (HS256_SECRET.encode() + b"\r\n", HS256_SECRET.encode()),
        (HS256_SECRET.encode() + b"\n\n", HS256_SECRET.encode() + b"\n"),
        (b" " + HS256_SECRET.encode() + b" \n", b" " + HS256_SECRET.encode() + b" "),
    ],
)
def test_secret_file_loses_exactly_one_trailing_newline(content: bytes, secret: bytes) -> None:
    config = parse(verify("alg: HS256, secret_file: k"), files={"k": content})
    assert config.sessions[0].token.verify == VerifyConfig("HS256", secret)


@pytest.mark.parametrize("alg", ["EdDSA", "ES256"])
def test_public_key_file_is_kept_as_pem(alg: str) -> None:
    pem = public_pem(alg)
    text = verify(f"alg: {alg}, public_key_file: k.pem")
    config = parse(text, files={"k.pem": pem})
    assert config.sessions[0].token.verify == VerifyConfig(alg, pem)


def test_anchors_and_merge_keys_are_not_duplicates() -> None:
    text = """
        timeouts: &slow {connect_s: 5, first_byte_s: 600}
        limits: {header_timeout_s: 5}
        workers:
          - &w {id: w0, url: "http://127.0.0.1:9001"}
          - {<<: *w, id: w1, url: "http://127.0.0.1:9002"}
    """
    config = parse(text)
    assert config.timeouts == TimeoutsConfig(5.0, 600.0, 300.0, 30.0)
    assert config.workers == (
        StaticWorkerConfig("w0", "http://127.0.0.1:9001"),
        StaticWorkerConfig("w1", "http://127.0.0.1:9002"),
    )


def test_workers_and_spawn_may_both_be_present_on_distinct_ports() -> None:
    text = """
        workers: [{id: static, url: "http://127.0.0.1:9000"}]
        spawn: {command: "srv --port {port}", count: 2, base_port: 9001}
    """
    config = parse(text)
    assert config.workers == (StaticWorkerConfig("static", "http://127.0.0.1:9000"),)
    assert config.spawn == SpawnConfig("srv --port {port}", 2, 9001, "127.0.0.1", 10.0)


@pytest.mark.parametrize(
    ("host", "upstreams"),
    [
        ("LOCALHOST", "[]"),  # host names are case-insensitive
        ("::1", "[]"),
        ("10.0.0.7", "['http://10.0.0.7:9001', 'http://10.0.0.7:9002']"),
    ],
)
def test_spawned_workers_on_loopback_or_on_allowed_urls_pass(host: str, upstreams: str) -> None:
    text = f"""
        control: {{allowed_upstreams: {upstreams}}}
        spawn: {{command: "srv --port {{port}}", count: 2, host: "{host}"}}
    """
    assert parse(text).spawn == SpawnConfig("srv --port {port}", 2, 9001, host, 10.0)


def test_dataclasses_are_frozen_and_slotted() -> None:
    config = default_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.listen.port = 1  # type: ignore[misc]
    assert not hasattr(config.control, "__dict__")


def test_config_error_carries_its_parts_and_pickles() -> None:
    error = ConfigError("a.yaml", "listen.port", "must be between 0 and 65535, got 70000")
    assert (error.source, error.key_path, error.reason) == (
        "a.yaml",
        "listen.port",
        "must be between 0 and 65535, got 70000",
    )
    assert str(error) == "a.yaml: listen.port: must be between 0 and 65535, got 70000"
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


# ---------------------------------------------------------------------------- session kinds

STARLETTE_SECRET = "s"  # Starlette's secret_key may be any length


def sessions(*kinds: str) -> str:
    return "sessions:\n" + "".join(f"  - {k}\n" for k in kinds)


def test_nemo_gym_kinds_with_edge_verification() -> None:
    text = f"""
        sessions:
          - name: episode
            header: X-NeMo-Gym-Episode-Token
          - name: resources
            cookie:
              name: {RESOURCES_COOKIE}
              verify: {{secret_env: GYM_SECRET, max_age_s: 1209600}}
            seed: {{method: post, path: /seed_session}}
            close: {{method: POST, path: /close_session}}
          - name: mcp_token
            header: X-NeMo-Gym-Session-Token
            token:
              format: itsdangerous
              field: sid
              verify: {{secret_file: /secrets/gym, salt: nemo-gym-mcp-session-token}}
            seed: {{method: POST, path: /seed_session, learn: {{json_pointer: {MCP_POINTER}}}}}
          - name: mcp_session
            mcp: {{}}
            unclaimed: forward
    """
    config = parse(text, {"GYM_SECRET": STARLETTE_SECRET}, {"/secrets/gym": b"gym-key\n"})
    seed = RouteConfig("POST", "/seed_session", (LearnConfig(cookie=RESOURCES_COOKIE),))
    assert config.sessions == (
        EPISODE,
        SessionKindConfig(
            "resources",
            cookie=CookieSourceConfig(
                RESOURCES_COOKIE, "starlette", "session_id", SignatureConfig(b"s", 1209600.0)
            ),
            seed=seed,
            close=RouteConfig("POST", "/close_session"),
        ),
        SessionKindConfig(
            "mcp_token",
            "X-NeMo-Gym-Session-Token",
            TokenFormatConfig(
                "itsdangerous",
                "sid",
                None,
                SignatureConfig(b"gym-key", None, "nemo-gym-mcp-session-token"),
            ),
            seed=RouteConfig("POST", "/seed_session", (LearnConfig(json_pointer=MCP_POINTER),)),
        ),
        SessionKindConfig("mcp_session", mcp=McpSourceConfig(), unclaimed="forward"),
    )
    assert [k.source for k in config.sessions] == ["header", "cookie", "header", "mcp"]
    cookie = config.sessions[1].cookie
    assert cookie is not None and cookie.signature is not None
    assert type(cookie.signature.max_age_s) is float


def test_every_source_form() -> None:
    text = sessions(
        "{name: raw_cookie, cookie: {name: sid, format: raw}}",
        "{name: other_cookie, cookie: {name: s2, field: rollout}}",
        "{name: mcp, mcp: {path: /v1/mcp, header: X-Mcp-Session}}",
        "{name: short_body, body_field: session_id}",
        "{name: escaped_body, body_field: 'a/b~c'}",
        "{name: long_body, body_field: {pointer: /params/0/id, max_bytes: 16777216}}",
        "{name: rollout_path, path: '/rollouts/{key}/stop'}",
        "{name: key_first, path: '/{key}/events'}",
        "{name: bare_token, header: X-Bare, token: {format: itsdangerous, field: sid}}",
    )
    kinds = parse(text).sessions
    assert kinds == (
        SessionKindConfig("raw_cookie", cookie=CookieSourceConfig("sid", "raw")),
        SessionKindConfig("other_cookie", cookie=CookieSourceConfig("s2", "starlette", "rollout")),
        SessionKindConfig("mcp", mcp=McpSourceConfig("/v1/mcp", "X-Mcp-Session")),
        SessionKindConfig("short_body", body_field=BodyFieldConfig("/session_id", 65536)),
        SessionKindConfig("escaped_body", body_field=BodyFieldConfig("/a~1b~0c")),
        SessionKindConfig("long_body", body_field=BodyFieldConfig("/params/0/id", 16 << 20)),
        SessionKindConfig("rollout_path", path=PathSourceConfig("/rollouts/{key}/stop")),
        SessionKindConfig("key_first", path=PathSourceConfig("/{key}/events")),
        SessionKindConfig("bare_token", "X-Bare", TokenFormatConfig("itsdangerous", "sid")),
    )
    assert [k.source for k in kinds] == [
        *("cookie", "cookie", "mcp", "body_field", "body_field", "body_field"),
        *("path", "path", "header"),
    ]


def test_seed_learn_defaults_are_filled_in() -> None:
    text = sessions(
        "{name: c, cookie: {name: sid}, seed: {method: POST, path: /seed}}",
        "{name: h, header: X-Chat, token: {format: raw}, seed: {method: put, path: /chat}}",
        "{name: j, header: X-Jws, seed: {method: POST, path: /seed}}",
        "{name: b, body_field: id, seed: {method: POST, path: /seed, learn: {json_pointer: /id}}}",
        "{name: p, path: '/r/{key}', seed: {method: POST, path: /r, learn: {header: X_Id}}}",
        "{name: o, header: X-O, token: {format: raw}, "
        "seed: {method: POST, path: /seed, learn: {cookie: other}}}",
    )
    seeds = [kind.seed for kind in parse(text).sessions]
    assert seeds == [
        RouteConfig("POST", "/seed", (LearnConfig(cookie="sid"),)),
        RouteConfig("PUT", "/chat", (LearnConfig(header="X-Chat"),)),
        RouteConfig("POST", "/seed", (LearnConfig(header="X-Jws"),)),
        RouteConfig("POST", "/seed", (LearnConfig(json_pointer="/id"),)),
        RouteConfig("POST", "/r", (LearnConfig(header="X_Id"),)),
        RouteConfig("POST", "/seed", (LearnConfig(cookie="other"),)),
    ]


def test_close_routes_are_shared_and_any_kind_but_a_path_one_may_have_one() -> None:
    text = sessions(
        "{name: a, cookie: {name: a}, close: {method: POST, path: /close}}",
        "{name: b, body_field: id, close: {method: post, path: /close}}",
        "{name: m, mcp: {}, close: {method: DELETE, path: /sessions}}",
    )
    closes = [kind.close for kind in parse(text).sessions]
    assert closes == [
        RouteConfig("POST", "/close"),
        RouteConfig("POST", "/close"),
        RouteConfig("DELETE", "/sessions"),
    ]
    assert all(kind.seed is None for kind in parse(text).sessions)


def test_the_example_file_commented_kinds_parse() -> None:
    """The body_field and path kinds shown commented out in the example are valid as written."""
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    uncommented = [
        "  " + line[4:] if line.startswith(("  # - ", "  #   ")) else line for line in lines
    ]
    config = parse_config("\n".join(uncommented), source=str(EXAMPLE))
    by_name = {kind.name: kind for kind in config.sessions}
    assert by_name["rollout"] == SessionKindConfig(
        "rollout",
        body_field=BodyFieldConfig("/session_id", 65536),
        seed=RouteConfig("POST", "/rollouts", (LearnConfig(json_pointer="/session_id"),)),
    )
    assert by_name["rollout_path"] == SessionKindConfig(
        "rollout_path",
        path=PathSourceConfig("/rollouts/{key}/stop"),
        seed=RouteConfig("POST", "/rollouts", (LearnConfig(header="X-Rollout-Id"),)),
    )
    assert by_name["resources_session"] == SessionKindConfig(
        "resources_session",
        body_field=BodyFieldConfig("/resources_session_id", 65536),
        seed=RouteConfig("POST", "/seed_session", (LearnConfig(request=True),)),
        close=RouteConfig("POST", "/close_session"),
    )
    assert len(config.sessions) == 8


def test_default_kind_keeps_its_old_shape() -> None:
    kind = default_config().sessions[0]
    assert kind == SessionKindConfig("episode", "X-NeMo-Gym-Episode-Token", TokenFormatConfig())
    assert (kind.source, kind.cookie, kind.mcp, kind.body_field, kind.path) == (
        "header",
        None,
        None,
        None,
        None,
    )
    assert (kind.seed, kind.close, kind.unclaimed) == (None, None, "reject")


# ---------------------------------------------------------------------------- bad files


class Bad(NamedTuple):
    text: str
    key_path: str
    reason: str  # a fragment of the reason
    env: Mapping[str, str] | None = None
    files: Mapping[str, bytes] | None = None


TOP_KEYS = (
    "listen, admin, control, workers, health, spawn, sessions, path_prefixes, claims, state, "
    "limits, timeouts, log"
)


BAD: dict[str, Bad] = {
    # unknown keys, at every level, with the allowed keys
    "unknown top key": Bad(
        "lsiten: {}", "lsiten", f"unknown key 'lsiten'; allowed keys: {TOP_KEYS}"
    ),
    "unknown nested key": Bad(
        "listen: {prot: 1}", "listen.prot", "unknown key 'prot'; allowed keys: host, port"
    ),
    "unknown key in a list item": Bad(
        "workers: [{id: w, url: 'http://h:1', weight: 2}]",
        "workers[0].weight",
        "allowed keys: id, url",
    ),
    "unknown key in verify": Bad(
        verify("alg: HS256, secret_env: S, kid: k1"),
        f"{VERIFY}.kid",
        "allowed keys: alg, secret_env, secret_file, public_key_file",
    ),
    # types
    "bool where int": Bad(
        "listen: {port: true}", "listen.port", "expected an integer, got a boolean (true)"
    ),
    "str where int": Bad(
        "listen: {port: '8080'}", "listen.port", "expected an integer, got a string ('8080')"
    ),
    "float where int": Bad(
        "health: {failures: 2.5}", "health.failures", "expected an integer, got a number (2.5)"
    ),
    "null where int": Bad("listen: {port: null}", "listen.port", "expected an integer, got null"),
    "list where mapping": Bad("listen: [1]", "listen", "expected a mapping, got a list"),
    "scalar top level": Bad(
        "just text", "(root)", "expected a mapping, got a string ('just text')"
    ),
    "list top level": Bad("- listen", "(root)", "expected a mapping, got a list"),
    "mapping where list": Bad("workers: {id: w0}", "workers", "expected a list, got a mapping"),
    "null list item": Bad("workers: [null]", "workers[0]", "expected a mapping, got null"),
    "scalar list item": Bad(
        "workers: [w0]", "workers[0]", "expected a mapping, got a string ('w0')"
    ),
    "bool where float": Bad(
        "timeouts: {connect_s: true}", "timeouts.connect_s", "got a boolean (true)"
    ),
    "str where float": Bad(
        "timeouts: {connect_s: 2s}", "timeouts.connect_s", "got a string ('2s')"
    ),
    "str where bool": Bad(
        "log: {access: 'yes'}", "log.access", "expected true or false, got a string"
    ),
    "int where str": Bad(
        "listen: {host: 127}", "listen.host", "expected a non-empty string, got an integer (127)"
    ),
    "empty str": Bad(
        "state: {path: ''}", "state.path", "expected a non-empty string, got a string ('')"
    ),
    "date where str": Bad("state: {path: 2024-01-01}", "state.path", "got a date"),
    "non-string key": Bad("listen: {1: 2}", "listen", "keys must be strings, got an integer (1)"),
    "long value is cut": Bad(f"listen: {{host: '{'h' * 300} x'}}", "listen.host", "hhh...'"),
    # ranges
    "port too big": Bad(
        "listen: {port: 65536}", "listen.port", "must be between 0 and 65535, got 65536"
    ),
    "negative port": Bad("admin: {port: -1}", "admin.port", "must be between 0 and 65535, got -1"),
    "zero failures": Bad("health: {failures: 0}", "health.failures", "between 1 and 1000"),
    "zero seconds": Bad("timeouts: {connect_s: 0}", "timeouts.connect_s", "must be above 0"),
    "negative seconds": Bad("claims: {tombstone_ttl_s: -1.5}", "claims.tombstone_ttl_s", "above 0"),
    "infinite seconds": Bad("limits: {idle_timeout_s: .inf}", "limits.idle_timeout_s", "got inf"),
    "nan seconds": Bad("limits: {header_timeout_s: .nan}", "limits.header_timeout_s", "got nan"),
    "huge seconds": Bad("timeouts: {first_byte_s: 1.0e+12}", "timeouts.first_byte_s", "at most"),
    "exponent read as a string": Bad(
        "timeouts: {first_byte_s: 1e3}", "timeouts.first_byte_s", "got a string ('1e3') (YAML needs"
    ),
    "zero body limit": Bad("limits: {max_body_bytes: 0}", "limits.max_body_bytes", "between 1 and"),
    "zero headers": Bad("limits: {max_headers: 0}", "limits.max_headers", "between 1 and"),
    "zero tombstones": Bad("claims: {max_tombstones: 0}", "claims.max_tombstones", "between 1 and"),
    "negative uid": Bad(
        "control: {allowed_uids: [0, -1]}", "control.allowed_uids[1]", "between 0 and"
    ),
    "bool uid": Bad("control: {allowed_uids: [true]}", "control.allowed_uids[0]", "got a boolean"),
    "bad log format": Bad(
        "log: {format: xml}", "log.format", "must be one of json, plain; got 'xml'"
    ),
    "bad log level": Bad(
        "log: {level: verbose}", "log.level", "one of debug, info, warning, error"
    ),
    "bad unclaimed": Bad(
        kind(extra=", unclaimed: drop"), "sessions[0].unclaimed", "one of reject, forward"
    ),
    "bad listen host": Bad(
        "listen: {host: 'my host'}", "listen.host", "expected a host name or IP"
    ),
    "health path without slash": Bad("health: {path: health}", "health.path", "starting with /"),
    # duplicate YAML keys
    "duplicate top key": Bad("log: {}\nlisten: {}\nlog: {}", "log", "duplicate key 'log' (line 3)"),
    "duplicate nested key": Bad(
        "listen:\n  port: 1\n  host: h\n  port: 2\n", "listen.port", "duplicate key 'port' (line 4)"
    ),
    "duplicate key in list item": Bad(
        "workers: [{id: a, url: 'http://h:1', id: b}]", "workers[0].id", "duplicate key 'id'"
    ),
    # worker urls and ids
    "url without scheme": Bad(
        "workers: [{id: w, url: '127.0.0.1:9001'}]",
        "workers[0].url",
        "expected http://host:port or unix:/absolute/path, got '127.0.0.1:9001'",
    ),
    "url without port": Bad(
        "workers: [{id: w, url: 'http://h'}]", "workers[0].url", "expected http://"
    ),
    "close route on a path kind": Bad(
        "sessions: [{name: p, path: '/r/{key}/step', close: {method: POST, path: /r/close}}]",
        "sessions[0].close",
        "a path kind's key is in its path pattern, which no exact close route matches",
    ),
    "url with path": Bad(
        "workers: [{id: w, url: 'http://h:1/'}]", "workers[0].url", "expected http://"
    ),
    "https url": Bad(
        "workers: [{id: w, url: 'https://h:1'}]", "workers[0].url", "expected http://"
    ),
    "url port zero": Bad(
        "workers: [{id: w, url: 'http://h:0'}]", "workers[0].url", "expected http://"
    ),
    "url unbracketed v6": Bad(
        "workers: [{id: w, url: 'http://::1:9'}]", "workers[0].url", "expected"
    ),
    "url userinfo": Bad("workers: [{id: w, url: 'http://u@h:1'}]", "workers[0].url", "expected"),
    "relative unix url": Bad(
        "workers: [{id: w, url: 'unix:w.sock'}]", "workers[0].url", "expected"
    ),
    "bad allowed upstream": Bad(
        "control: {allowed_upstreams: ['http://h:1', 'h:2']}",
        "control.allowed_upstreams[1]",
        "expected",
    ),
    "missing url": Bad("workers: [{id: w}]", "workers[0].url", "missing required key"),
    "bad worker id": Bad(
        "workers: [{id: 'w/0', url: 'http://h:1'}]", "workers[0].id", "must be 1 to 64"
    ),
    "duplicate worker id": Bad(
        "workers: [{id: w, url: 'http://h:1'}, {id: w, url: 'http://h:2'}]",
        "workers[1].id",
        "duplicate worker id 'w' (also workers[0])",
    ),
    "duplicate worker url": Bad(
        "workers: [{id: a, url: 'http://h:1'}, {id: b, url: 'http://h:1'}]",
        "workers[1].url",
        "duplicate worker url 'http://h:1' (also workers[0])",
    ),
    # control socket
    "socket without scheme": Bad(
        "control: {socket: /run/c.sock}", "control.socket", "expected unix:PATH or tcp://HOST:PORT"
    ),
    "empty unix path": Bad("control: {socket: 'unix:'}", "control.socket", "needs a path"),
    "unix path too long": Bad(
        f"control: {{socket: 'unix:/{'x' * 107}'}}", "control.socket", "longer than 107"
    ),
    "tcp without port": Bad(
        "control: {socket: 'tcp://127.0.0.1'}", "control.socket", "expected unix:PATH"
    ),
    "tcp port too big": Bad(
        "control: {socket: 'tcp://127.0.0.1:99999'}", "control.socket", "expected"
    ),
    "tcp without secret": Bad(
        "control: {socket: 'tcp://127.0.0.1:9902'}",
        "control.socket",
        "a tcp:// control socket needs secret_env or secret_file",
    ),
    "tcp on a LAN address": Bad(
        "control: {socket: 'tcp://10.0.0.1:9902', secret_env: S}",
        "control.socket",
        "must be on loopback (127.0.0.0/8, ::1, localhost), got '10.0.0.1'",
        {"S": SHARED_SECRET},
    ),
    "tcp on all interfaces": Bad(
        "control: {socket: 'tcp://0.0.0.0:9902'}", "control.socket", "loopback"
    ),
    "secret on a unix socket": Bad(
        "control: {secret_env: S}",
        "control.secret_env",
        "a secret is for tcp://",
        {"S": SHARED_SECRET},
    ),
    "uids on a tcp socket": Bad(
        "control: {socket: 'tcp://127.0.0.1:9902', secret_env: S, allowed_uids: [1000]}",
        "control.allowed_uids",
        "only be checked on a unix: control socket",
        {"S": SHARED_SECRET},
    ),
    "short control secret": Bad(
        "control: {socket: 'tcp://127.0.0.1:9902', secret_env: S}",
        "control.secret_env",
        "at least 16 bytes, got 5",
        {"S": "short"},
    ),
    # admin
    "admin off loopback without token": Bad(
        "admin: {host: 0.0.0.0}",
        "admin",
        "an admin listener on '0.0.0.0' (not loopback) needs token_env",
    ),
    "admin token with spaces": Bad(
        "admin: {token_env: T}", "admin.token_env", "visible ASCII", {"T": "admin token 0123456789"}
    ),
    "admin token in two places": Bad(
        "admin: {token_env: T, token_file: t}",
        "admin.token_file",
        "set only one of token_env and token_file",
    ),
    # inline secrets
    "inline admin token": Bad(
        "admin: {token: hunter2}",
        "admin.token",
        "inline secrets are not allowed; use token_env or token_file",
    ),
    "inline control secret": Bad(
        "control: {secret: x}", "control.secret", "use secret_env or secret_file"
    ),
    "inline verify secret": Bad(
        verify("alg: HS256, secret: x"), f"{VERIFY}.secret", "inline secrets"
    ),
    "inline verify key": Bad(verify("alg: HS256, key: x"), f"{VERIFY}.key", "inline secrets"),
    "inline public key": Bad(
        verify("alg: EdDSA, public_key: x"), f"{VERIFY}.public_key", "public_key_file"
    ),
    # spawn
    "spawn without command": Bad("spawn: {count: 2}", "spawn.command", "missing required key"),
    "empty spawn section": Bad("spawn: {}", "spawn.command", "missing required key"),
    "spawn without {port}": Bad(
        "spawn: {command: 'srv --port 9001'}", "spawn.command", "must contain {port}"
    ),
    "spawn unknown placeholder": Bad(
        "spawn: {command: 'srv --port {port} --dir {home}'}",
        "spawn.command",
        "unknown placeholder {home}; allowed: {port}, {worker_id}, {host}",
    ),
    "spawn positional placeholder": Bad(
        "spawn: {command: 'srv {port} {}'}", "spawn.command", "placeholder {}"
    ),
    "spawn register": Bad(
        "spawn: {command: 'srv {port}', register: never}", "spawn.register", "hello, probe"
    ),
    "spawn env not a mapping": Bad(
        "spawn: {command: 'srv {port}', env: [A]}", "spawn.env", "expected a mapping"
    ),
    "spawn env name": Bad(
        "spawn: {command: 'srv {port}', env: {'A-B': x}}", "spawn.env.A-B", "variable name"
    ),
    "spawn env router's own": Bad(
        "spawn: {command: 'srv {port}', env: {EPISODE_ROUTER_X: x}}",
        "spawn.env.EPISODE_ROUTER_X",
        "set by the router itself",
    ),
    "spawn env placeholder": Bad(
        "spawn: {command: 'srv {port}', env: {A: '{home}'}}", "spawn.env.A", "unknown placeholder"
    ),
    "spawn env value not text": Bad(
        "spawn: {command: 'srv {port}', env: {A: 1}}", "spawn.env.A", "non-empty string"
    ),
    "spawn cwd placeholder": Bad(
        "spawn: {command: 'srv {port}', cwd: '/w/{home}'}", "spawn.cwd", "unknown placeholder"
    ),
    "spawn empty command": Bad(
        "spawn: {command: ' ', env: {P: '{port}'}}", "spawn.command", "no program"
    ),
    # path prefixes
    "path prefix not a list": Bad("path_prefixes: /ng", "path_prefixes", "expected a list"),
    "path prefix relative": Bad(
        "path_prefixes: ['ng/{id}']", "path_prefixes[0]", "starts with '/'"
    ),
    "path prefix placeholder only": Bad(
        "path_prefixes: ['/{id}']", "path_prefixes[0]", "needs a literal segment"
    ),
    "path prefix partial placeholder": Bad(
        "path_prefixes: ['/ng-{id}']", "path_prefixes[0]", "whole-segment"
    ),
    "path prefix twice": Bad(
        "path_prefixes: ['/a/{x}', '/a/{x}']", "path_prefixes[1]", "listed twice"
    ),
    # learn places
    "learn not request": Bad(
        "sessions: [{name: r, body_field: id, seed: {method: POST, path: /s, learn: reply}}]",
        "sessions[0].seed.learn",
        "expected request",
    ),
    "learn empty list": Bad(
        "sessions: [{name: r, body_field: id, seed: {method: POST, path: /s, learn: []}}]",
        "sessions[0].seed.learn",
        "learns nothing",
    ),
    "learn list item": Bad(
        "sessions: [{name: r, body_field: id, seed: {method: POST, path: /s, learn: [{x: 1}]}}]",
        "sessions[0].seed.learn[0].x",
        "unknown key",
    ),
    "spawn attribute placeholder": Bad(
        "spawn: {command: 'srv {port.real}'}", "spawn.command", "{port.real}"
    ),
    "spawn format spec": Bad(
        "spawn: {command: 'srv {port:>6}'}", "spawn.command", "no conversion or format"
    ),
    "spawn conversion": Bad(
        "spawn: {command: 'srv {port!r}'}", "spawn.command", "no conversion or format"
    ),
    "spawn broken brace": Bad(
        "spawn: {command: 'srv {port'}", "spawn.command", "malformed placeholder"
    ),
    "spawn count zero": Bad(
        "spawn: {command: '{port}', count: 0}", "spawn.count", "between 1 and 256"
    ),
    "spawn count too big": Bad(
        "spawn: {command: '{port}', count: 257}", "spawn.count", "between 1 and 256"
    ),
    "spawn ports past 65535": Bad(
        "spawn: {command: '{port}', count: 10, base_port: 65530}",
        "spawn.count",
        "ports 65530..65539 go past 65535",
    ),
    "spawn command with an unbalanced quote": Bad(
        """spawn: {command: "srv --port {port} --name 'w"}""",
        "spawn.command",
        "cannot be split into arguments the way a shell would: No closing quotation",
    ),
    "spawn command with a NUL byte": Bad(
        'spawn: {command: "srv --port {port}\\0"}', "spawn.command", "must not contain a NUL"
    ),
    # spawned workers that could never register
    "static worker with a spawned worker's id": Bad(
        "workers: [{id: w1, url: 'http://127.0.0.1:9000'}]\nspawn: {command: '{port}', count: 2}",
        "workers[0].id",
        "'w1' is also a spawned worker's id (spawn makes w0..w1)",
    ),
    "spawn host off loopback": Bad(
        "spawn: {command: '{port}', host: 0.0.0.0}",
        "spawn.host",
        "'0.0.0.0' is not loopback, and control.allowed_upstreams does not list "
        "'http://0.0.0.0:9001': the spawned workers could never say hello",
    ),
    "spawn host with one of its urls not allowed": Bad(
        "control: {allowed_upstreams: ['http://10.0.0.7:9001']}\n"
        "spawn: {command: '{port}', count: 2, host: 10.0.0.7}",
        "spawn.host",
        "does not list 'http://10.0.0.7:9002'",
    ),
    # addresses that clash
    "listen and admin on one port": Bad(
        "listen: {host: 127.0.0.1, port: 9000}\nadmin: {port: 9000}",
        "admin.port",
        "address clashes with listen.port",
    ),
    "admin under a wildcard listener": Bad(
        "admin: {port: 8080}", "admin.port", "clashes with listen.port"
    ),
    "tcp control on the admin port": Bad(
        "control: {socket: 'tcp://localhost:9901', secret_env: S}",
        "control.socket",
        "clashes with admin.port",
        {"S": SHARED_SECRET},
    ),
    "spawned ports over the listener": Bad(
        "spawn: {command: '{port}', base_port: 8079, count: 3}",
        "spawn.base_port",
        "clashes with listen",
    ),
    "worker at the router's own port": Bad(
        "workers: [{id: w, url: 'http://localhost:8080'}]",
        "workers[0].url",
        "is the router's own listen.port address",
    ),
    "static worker on a spawned port": Bad(
        "workers: [{id: w, url: 'http://127.0.0.1:9002'}]\nspawn: {command: '{port}', count: 2}",
        "workers[0].url",
        "is the router's own spawn.base_port address",
    ),
    # session kinds
    "empty sessions": Bad("sessions: []", "sessions", "needs at least one kind"),
    "session without a source": Bad(
        "sessions: [{name: e}]",
        "sessions[0]",
        "needs a key source: one of header, cookie, mcp, body_field, path (`mcp: {}` for MCP",
    ),
    "session with a null source": Bad(
        "sessions: [{name: e, mcp: null}]", "sessions[0]", "needs a key source"
    ),
    "session without name": Bad(
        "sessions: [{header: X-T}]", "sessions[0].name", "missing required key"
    ),
    "bad session name": Bad(
        "sessions: [{name: Episode, header: X-T}]",
        "sessions[0].name",
        "must be 1 to 32 of a-z 0-9 _",
    ),
    "bad header": Bad(
        "sessions: [{name: e, header: 'X T'}]", "sessions[0].header", "not an HTTP header"
    ),
    "underscore header": Bad(
        "sessions: [{name: e, header: X_T}]", "sessions[0].header", "with '_'"
    ),
    "reserved header": Bad(
        "sessions: [{name: e, header: Host}]", "sessions[0].header", "rewritten or stripped"
    ),
    "internal header": Bad(
        "sessions: [{name: e, header: X-Episode-Router-Boot}]",
        "sessions[0].header",
        "rewritten or stripped",
    ),
    "duplicate session names": Bad(
        "sessions: [{name: e, header: X-A}, {name: e, header: X-B}]",
        "sessions[1].name",
        "duplicate session kind 'e' (also sessions[0])",
    ),
    "duplicate session headers": Bad(
        "sessions: [{name: a, header: X-Token}, {name: b, header: x-token}]",
        "sessions[1].header",
        "header 'x-token' is also read by sessions[0]",
    ),
    # session sources
    "two sources": Bad(
        "sessions: [{name: e, header: X-T, cookie: {name: c}}]",
        "sessions[0].cookie",
        "a kind reads one key source; this one also has header",
    ),
    "mcp and body": Bad(
        "sessions: [{name: e, mcp: {}, body_field: id}]",
        "sessions[0].body_field",
        "also has mcp",
    ),
    "token on a cookie kind": Bad(
        "sessions: [{name: e, cookie: {name: c}, token: {format: raw}}]",
        "sessions[0].token",
        "only a header kind reads a token; this kind reads a cookie",
    ),
    "unknown kind key": Bad(
        "sessions: [{name: e, header: X-T, learn: {}}]",
        "sessions[0].learn",
        "allowed keys: name, header, token, cookie, mcp, body_field, path, seed, close, unclaimed",
    ),
    # itsdangerous tokens
    "itsdangerous without field": Bad(
        kind("{format: itsdangerous}"), "sessions[0].token.field", "needs the payload field"
    ),
    "itsdangerous empty field": Bad(
        kind("{format: itsdangerous, field: ''}"), "sessions[0].token.field", "non-empty string"
    ),
    "itsdangerous verify with alg": Bad(
        kind("{format: itsdangerous, field: sid, verify: {alg: HS256, secret_env: S}}"),
        VERIFY + ".alg",
        "itsdangerous tokens are signed with HMAC-SHA1; alg is for jws tokens",
    ),
    "itsdangerous verify with max age": Bad(
        kind("{format: itsdangerous, field: sid, verify: {secret_env: S, max_age_s: 5}}"),
        VERIFY + ".max_age_s",
        "carry no timestamp",
    ),
    "itsdangerous verify without secret": Bad(
        kind("{format: itsdangerous, field: sid, verify: {salt: s}}"),
        VERIFY,
        "needs the server's secret key: secret_env or secret_file",
    ),
    "itsdangerous verify with two secrets": Bad(
        kind("{format: itsdangerous, field: sid, verify: {secret_env: S, secret_file: f}}"),
        VERIFY + ".secret_file",
        "set only one of secret_env and secret_file",
    ),
    "itsdangerous inline secret": Bad(
        kind("{format: itsdangerous, field: sid, verify: {secret: x}}"),
        VERIFY + ".secret",
        "inline secrets are not allowed",
    ),
    "itsdangerous unset secret": Bad(
        kind("{format: itsdangerous, field: sid, verify: {secret_env: S}}"),
        VERIFY + ".secret_env",
        "environment variable S is not set or is empty",
    ),
    "itsdangerous empty secret file": Bad(
        kind("{format: itsdangerous, field: sid, verify: {secret_file: k}}"),
        VERIFY + ".secret_file",
        "the secret must be at least 1 byte, got 0",
        files={"k": b"\n"},
    ),
    "itsdangerous empty salt": Bad(
        kind("{format: itsdangerous, field: sid, verify: {secret_env: S, salt: ''}}"),
        VERIFY + ".salt",
        "non-empty string",
        {"S": "k"},
    ),
    # cookies
    "cookie without name": Bad(
        "sessions: [{name: e, cookie: {format: raw}}]",
        "sessions[0].cookie.name",
        "missing required key",
    ),
    "cookie name with a space": Bad(
        "sessions: [{name: e, cookie: {name: 'a b'}}]",
        "sessions[0].cookie.name",
        "not a cookie name (1 to 128 RFC 6265 token characters): 'a b'",
    ),
    "cookie name with '='": Bad(
        "sessions: [{name: e, cookie: {name: 'a=b'}}]", "sessions[0].cookie.name", "not a cookie"
    ),
    "cookie as a string": Bad(
        "sessions: [{name: e, cookie: sid}]",
        "sessions[0].cookie",
        "expected a mapping, got a string ('sid')",
    ),
    "unknown cookie format": Bad(
        "sessions: [{name: e, cookie: {name: c, format: flask}}]",
        "sessions[0].cookie.format",
        "must be one of starlette, raw; got 'flask'",
    ),
    "raw cookie with field": Bad(
        "sessions: [{name: e, cookie: {name: c, format: raw, field: f}}]",
        "sessions[0].cookie.field",
        "a raw cookie's value is the key itself",
    ),
    "raw cookie with verify": Bad(
        "sessions: [{name: e, cookie: {name: c, format: raw, verify: {secret_env: S}}}]",
        "sessions[0].cookie.verify",
        "a raw cookie's value is the key itself",
    ),
    "unknown cookie key": Bad(
        "sessions: [{name: e, cookie: {name: c, path: /}}]",
        "sessions[0].cookie.path",
        "allowed keys: name, format, field, verify",
    ),
    "cookie verify with salt": Bad(
        "sessions: [{name: e, cookie: {name: c, verify: {secret_env: S, salt: x}}}]",
        "sessions[0].cookie.verify.salt",
        "Starlette's SessionMiddleware signs with itsdangerous' default salt",
    ),
    "cookie verify zero max age": Bad(
        "sessions: [{name: e, cookie: {name: c, verify: {secret_env: S, max_age_s: 0}}}]",
        "sessions[0].cookie.verify.max_age_s",
        "must be above 0",
        {"S": "k"},
    ),
    "cookie verify without secret": Bad(
        "sessions: [{name: e, cookie: {name: c, verify: {max_age_s: 10}}}]",
        "sessions[0].cookie.verify",
        "needs the server's secret key",
    ),
    "duplicate cookie names": Bad(
        "sessions: [{name: a, cookie: {name: c}}, {name: b, cookie: {name: c, format: raw}}]",
        "sessions[1].cookie.name",
        "cookie 'c' is also read by sessions[0]",
    ),
    # MCP
    "two mcp kinds": Bad(
        "sessions: [{name: a, mcp: {}}, {name: b, mcp: {path: /other, header: X-Other}}]",
        "sessions[1].mcp",
        "only one kind may read MCP sessions: sessions[0] does",
    ),
    "mcp header read by a header kind": Bad(
        "sessions: [{name: a, header: mcp-session-id, token: {format: raw}}, {name: b, mcp: {}}]",
        "sessions[1].mcp.header",
        "header 'Mcp-Session-Id' is also read by sessions[0]",
    ),
    "header kind reading the mcp header": Bad(
        "sessions: [{name: a, mcp: {header: X-S}}, {name: b, header: X-S}]",
        "sessions[1].header",
        "header 'X-S' is also read by sessions[0]",
    ),
    "mcp path without slash": Bad(
        "sessions: [{name: a, mcp: {path: mcp}}]", "sessions[0].mcp.path", "an exact path"
    ),
    "mcp path with query": Bad(
        "sessions: [{name: a, mcp: {path: '/mcp?x=1'}}]", "sessions[0].mcp.path", "without ? or #"
    ),
    "mcp underscore header": Bad(
        "sessions: [{name: a, mcp: {header: Mcp_Session}}]", "sessions[0].mcp.header", "with '_'"
    ),
    "mcp as true": Bad(
        "sessions: [{name: a, mcp: true}]", "sessions[0].mcp", "expected a mapping, got a boolean"
    ),
    "mcp with a seed": Bad(
        "sessions: [{name: a, mcp: {}, seed: {method: POST, path: /mcp}}]",
        "sessions[0].seed",
        "an mcp kind learns Mcp-Session-Id from every reply on its path; it has no seed",
    ),
    # body fields
    "body field short form with a slash": Bad(
        "sessions: [{name: a, body_field: /session_id}]",
        "sessions[0].body_field",
        "a field name; for a JSON pointer write {pointer: /session_id}",
    ),
    "body field bad pointer": Bad(
        "sessions: [{name: a, body_field: {pointer: session_id}}]",
        "sessions[0].body_field.pointer",
        "not an RFC 6901 JSON pointer: a JSON pointer starts with '/'; got 'session_id'",
    ),
    "body field bad escape": Bad(
        "sessions: [{name: a, body_field: {pointer: /a~2}}]",
        "sessions[0].body_field.pointer",
        "must be followed by 0 or 1",
    ),
    "body field without pointer": Bad(
        "sessions: [{name: a, body_field: {max_bytes: 10}}]",
        "sessions[0].body_field.pointer",
        "missing required key",
    ),
    "body field zero bytes": Bad(
        "sessions: [{name: a, body_field: {pointer: /id, max_bytes: 0}}]",
        "sessions[0].body_field.max_bytes",
        "must be between 1 and 16777216, got 0",
    ),
    "body field too many bytes": Bad(
        "sessions: [{name: a, body_field: {pointer: /id, max_bytes: 16777217}}]",
        "sessions[0].body_field.max_bytes",
        "must be between 1 and 16777216",
    ),
    "body field as a number": Bad(
        "sessions: [{name: a, body_field: 5}]",
        "sessions[0].body_field",
        "expected a mapping, got an integer (5)",
    ),
    "duplicate body fields": Bad(
        "sessions: [{name: a, body_field: id}, {name: b, body_field: {pointer: /id}}]",
        "sessions[1].body_field",
        "body field '/id' is also read by sessions[0]",
    ),
    # paths
    "path without key": Bad(
        "sessions: [{name: a, path: /rollouts}]",
        "sessions[0].path",
        "a path pattern has exactly one {key} segment; got '/rollouts'",
    ),
    "path of only the key": Bad(
        "sessions: [{name: a, path: '/{key}'}]", "sessions[0].path", "needs a literal segment"
    ),
    "path with a star": Bad(
        "sessions: [{name: a, path: '/r/*/{key}'}]", "sessions[0].path", "'*' is not supported"
    ),
    "path with a partial key": Bad(
        "sessions: [{name: a, path: '/r/id-{key}'}]", "sessions[0].path", "exactly one {key}"
    ),
    "path as a mapping": Bad(
        "sessions: [{name: a, path: {pattern: '/r/{key}'}}]",
        "sessions[0].path",
        "expected a non-empty string, got a mapping",
    ),
    "duplicate paths": Bad(
        "sessions: [{name: a, path: '/r/{key}'}, {name: b, path: '/r/{key}'}]",
        "sessions[1].path",
        "path '/r/{key}' is also read by sessions[0]",
    ),
    # seed and close routes
    "body kind seed without learn": Bad(
        "sessions: [{name: a, body_field: id, seed: {method: POST, path: /seed}}]",
        "sessions[0].seed.learn",
        "a body_field kind needs learn: {json_pointer, header or cookie} to find its key",
    ),
    "path kind seed without learn": Bad(
        "sessions: [{name: a, path: '/r/{key}', seed: {method: POST, path: /r}}]",
        "sessions[0].seed.learn",
        "a path kind needs learn",
    ),
    "learn with two places": Bad(
        "sessions: [{name: a, header: X-A, seed: {method: POST, path: /s, "
        "learn: {header: X-B, cookie: c}}}]",
        "sessions[0].seed.learn",
        "needs exactly one of json_pointer, header, cookie; got header and cookie",
    ),
    "learn with no place": Bad(
        "sessions: [{name: a, header: X-A, seed: {method: POST, path: /s, learn: {}}}]",
        "sessions[0].seed.learn",
        "got none",
    ),
    "learn from Set-Cookie as a header": Bad(
        "sessions: [{name: a, header: X-A, seed: {method: POST, path: /s, "
        "learn: {header: Set-Cookie}}}]",
        "sessions[0].seed.learn.header",
        "write learn: {cookie: NAME}",
    ),
    "learn from a framing header": Bad(
        "sessions: [{name: a, header: X-A, seed: {method: POST, path: /s, "
        "learn: {header: Transfer-Encoding}}}]",
        "sessions[0].seed.learn.header",
        "a framing header",
    ),
    "learn from a bad header": Bad(
        "sessions: [{name: a, header: X-A, seed: {method: POST, path: /s, "
        "learn: {header: 'X A'}}}]",
        "sessions[0].seed.learn.header",
        "not an HTTP header name",
    ),
    "learn from a bad cookie": Bad(
        "sessions: [{name: a, header: X-A, seed: {method: POST, path: /s, "
        "learn: {cookie: 'a;b'}}}]",
        "sessions[0].seed.learn.cookie",
        "not a cookie name",
    ),
    "learn a bad pointer": Bad(
        "sessions: [{name: a, header: X-A, seed: {method: POST, path: /s, "
        "learn: {json_pointer: mcp/headers}}}]",
        "sessions[0].seed.learn.json_pointer",
        "not an RFC 6901 JSON pointer",
    ),
    "unknown learn key": Bad(
        "sessions: [{name: a, header: X-A, seed: {method: POST, path: /s, learn: {body: x}}}]",
        "sessions[0].seed.learn.body",
        "allowed keys: json_pointer, header, cookie",
    ),
    "seed without path": Bad(
        "sessions: [{name: a, cookie: {name: c}, seed: {method: POST}}]",
        "sessions[0].seed.path",
        "missing required key",
    ),
    "seed without method": Bad(
        "sessions: [{name: a, cookie: {name: c}, seed: {path: /s}}]",
        "sessions[0].seed.method",
        "missing required key",
    ),
    "seed bad method": Bad(
        "sessions: [{name: a, cookie: {name: c}, seed: {method: 'PO ST', path: /s}}]",
        "sessions[0].seed.method",
        "not an HTTP method: 'PO ST'",
    ),
    "seed path with query": Bad(
        "sessions: [{name: a, cookie: {name: c}, seed: {method: POST, path: '/s?x=1'}}]",
        "sessions[0].seed.path",
        "expected an exact path: /, then visible ASCII without ? or #; got '/s?x=1'",
    ),
    "seed path with a space": Bad(
        "sessions: [{name: a, cookie: {name: c}, seed: {method: POST, path: '/a b'}}]",
        "sessions[0].seed.path",
        "expected an exact path",
    ),
    "seed as a string": Bad(
        "sessions: [{name: a, cookie: {name: c}, seed: /seed_session}]",
        "sessions[0].seed",
        "expected a mapping, got a string",
    ),
    "close with learn": Bad(
        "sessions: [{name: a, cookie: {name: c}, close: {method: POST, path: /c, "
        "learn: {cookie: c}}}]",
        "sessions[0].close.learn",
        "a close route releases the claim on a 2xx reply; it learns nothing",
    ),
    "close is the seed": Bad(
        "sessions: [{name: a, cookie: {name: c}, seed: {method: POST, path: /s}, "
        "close: {method: post, path: /s}}]",
        "sessions[0].close",
        "POST /s is also this kind's seed route",
    ),
    "close is another kind's seed": Bad(
        "sessions: [{name: a, cookie: {name: c}, seed: {method: POST, path: /s}}, "
        "{name: b, cookie: {name: d}, close: {method: POST, path: /s}}]",
        "sessions[1].close",
        "POST /s is the seed route of sessions[0]",
    ),
    "seed is another kind's close": Bad(
        "sessions: [{name: a, cookie: {name: c}, close: {method: POST, path: /s}}, "
        "{name: b, cookie: {name: d}, seed: {method: POST, path: /s}}]",
        "sessions[1].seed",
        "POST /s is the close route of sessions[0]",
    ),
    "token field": Bad(
        kind("{field: sid}"),
        "sessions[0].token.field",
        "only the itsdangerous format reads a field",
    ),
    "unknown format": Bad(
        kind("{format: jwt}"), "sessions[0].token.format", "must be one of jws, raw, itsdangerous"
    ),
    "verify on raw": Bad(
        kind("{format: raw, verify: {alg: HS256}}"), VERIFY, "it carries no signature to verify"
    ),
    # verification keys
    "verify without alg": Bad(verify("secret_env: S"), f"{VERIFY}.alg", "missing required key"),
    "verify alg none": Bad(
        verify("alg: none, secret_env: S"), f"{VERIFY}.alg", "one of HS256, EdDSA, ES256"
    ),
    "verify without source": Bad(verify("alg: HS256"), VERIFY, "exactly one key source, got none"),
    "verify with two sources": Bad(
        verify("alg: HS256, secret_env: S, secret_file: k"),
        VERIFY,
        "needs exactly one key source, got secret_env and secret_file; for HS256: secret_env or",
        {"S": HS256_SECRET},
        {"k": HS256_SECRET.encode()},
    ),
    "HS256 with a public key file": Bad(
        verify("alg: HS256, public_key_file: k.pem"),
        f"{VERIFY}.public_key_file",
        "HS256 takes its key from secret_env or secret_file",
    ),
    "EdDSA with a secret": Bad(
        verify("alg: EdDSA, secret_env: S"),
        f"{VERIFY}.secret_env",
        "EdDSA takes its key from public_key_file",
    ),
    "short HS256 secret": Bad(
        verify("alg: HS256, secret_env: S"),
        f"{VERIFY}.secret_env",
        "at least 32 bytes, got 6",
        {"S": "secret"},
    ),
    "secret env missing": Bad(
        verify("alg: HS256, secret_env: TOKEN_SECRET"),
        f"{VERIFY}.secret_env",
        "environment variable TOKEN_SECRET is not set or is empty",
        {"OTHER": HS256_SECRET},
    ),
    "secret env empty": Bad(
        verify("alg: HS256, secret_env: S"),
        f"{VERIFY}.secret_env",
        "is not set or is empty",
        {"S": ""},
    ),
    "no environment given": Bad(
        verify("alg: HS256, secret_env: S"), f"{VERIFY}.secret_env", "not set"
    ),
    "bad env name": Bad(
        verify("alg: HS256, secret_env: 'A-B'"),
        f"{VERIFY}.secret_env",
        "not an environment variable name",
    ),
    "secret file missing": Bad(
        verify("alg: HS256, secret_file: /s/k"),
        f"{VERIFY}.secret_file",
        "cannot read '/s/k': No such file or directory",
        files={},
    ),
    "no file reader given": Bad(
        verify("alg: HS256, secret_file: /s/k"),
        f"{VERIFY}.secret_file",
        "no file reader is available",
    ),
    "secret file empty": Bad(
        verify("alg: HS256, secret_file: k"), f"{VERIFY}.secret_file", "got 0", files={"k": b"\n"}
    ),
    "secret file too large": Bad(
        verify("alg: HS256, secret_file: k"),
        f"{VERIFY}.secret_file",
        "larger than",
        files={"k": b"x" * 70000},
    ),
    "public key file not PEM": Bad(
        verify("alg: EdDSA, public_key_file: k"),
        f"{VERIFY}.public_key_file",
        "is not a PEM public key",
        files={"k": b"-----BEGIN NONSENSE-----\n"},
    ),
    "P-384 key for ES256": Bad(
        verify("alg: ES256, public_key_file: k"),
        f"{VERIFY}.public_key_file",
        "ES256 needs a P-256",
        files={"k": public_pem("P-384")},
    ),
    "P-256 key for EdDSA": Bad(
        verify("alg: EdDSA, public_key_file: k"),
        f"{VERIFY}.public_key_file",
        "EdDSA needs an Ed25519 public key",
        files={"k": public_pem("ES256")},
    ),
    # YAML itself
    "YAML syntax error": Bad(
        "listen:\n  port: [8080\nadmin: {}\n", "(root)", "invalid YAML at line 3"
    ),
    "bad indentation": Bad("listen:\n  host: h\n   port: 1\n", "(root)", "at line 3, column 8"),
    "two documents": Bad("listen: {}\n---\nadmin: {}\n", "(root)", "expected a single document"),
    "python tag": Bad(
        "listen: !!python/object/apply:os.getcwd []", "(root)", "could not determine a constructor"
    ),
    "deep nesting": Bad("[" * 20000, "(root)", "YAML"),
    "tab indentation": Bad("listen:\n\tport: 1\n", "(root)", "invalid YAML at line 2"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_config_is_an_error_naming_key_path_and_reason(case: Bad) -> None:
    with pytest.raises(ConfigError) as info:
        parse(case.text, case.env, case.files)
    error = info.value
    assert (error.source, error.key_path) == (SOURCE, case.key_path)
    assert case.reason in error.reason
    assert str(error) == f"{SOURCE}: {case.key_path}: {error.reason}"


def test_secret_values_never_appear_in_errors() -> None:
    secret = "do-not-print-this-secret-0123456789"
    cases = [
        ("admin: {token: " + secret + "}", None),
        ("admin: {host: 0.0.0.0, token_env: T}", {"T": secret + " with spaces"}),
        (verify("alg: EdDSA, secret_env: S"), {"S": secret}),
        (
            "sessions: [{name: c, cookie: {name: c, verify: {secret_env: S, alg: x}}}]",
            {"S": secret},
        ),
        (kind("{format: itsdangerous, field: f, verify: {secret_env: S, salt: 1}}"), {"S": secret}),
    ]
    for text, env in cases:
        with pytest.raises(ConfigError) as info:
            parse(text, env)
        assert secret not in str(info.value)


def test_alias_bomb_fails_fast_without_expanding() -> None:
    # Ten levels of ten aliases: 10**10 strings if anything expanded or printed it.
    lines = ["state:", "  path:", "    - &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    - &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        parse("\n".join(lines))
    assert (info.value.key_path, info.value.reason) == (
        "state.path",
        "expected a non-empty string, got a list",
    )
    assert time.monotonic() - started < 2.0


# ---------------------------------------------------------------------------- load_config


def test_load_config_reads_the_file_and_real_secret_files(tmp_path: Path) -> None:
    secret_file = tmp_path / "token.secret"
    secret_file.write_bytes(HS256_SECRET.encode() + b"\n")
    config_file = tmp_path / "router.yaml"
    config_file.write_text(verify(f"alg: HS256, secret_file: '{secret_file}'"), encoding="utf-8")
    config = load_config(config_file)
    assert config.sessions[0].token.verify == VerifyConfig("HS256", HS256_SECRET.encode())


def test_load_config_uses_the_process_environment_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = tmp_path / "router.yaml"
    config_file.write_text("admin: {token_env: ER_TEST_ADMIN_TOKEN}\n", encoding="utf-8")
    monkeypatch.setenv("ER_TEST_ADMIN_TOKEN", ADMIN_TOKEN)
    assert load_config(config_file).admin == AdminConfig("127.0.0.1", 9901, ADMIN_TOKEN)
    with pytest.raises(ConfigError, match="ER_TEST_ADMIN_TOKEN is not set"):
        load_config(config_file, env={})


def test_load_config_empty_file_gives_defaults(tmp_path: Path) -> None:
    config_file = tmp_path / "empty.yaml"
    config_file.write_bytes(b"")
    assert load_config(config_file) == DEFAULTS


@pytest.mark.parametrize(
    ("content", "key_path", "reason"),
    [
        (b"listen:\n  port: 8080\n  hots: x\n", "listen.hots", "unknown key 'hots'"),
        (b"listen:\n  port: [8080\n", "(root)", "invalid YAML at line 3, column 1"),
        (b"listen: {host: \xff}\n", "(file)", "not UTF-8 (bad byte at offset 15)"),
        (b"x" * ((1 << 20) + 1), "(file)", "larger than 1048576 bytes"),
        (
            verify("alg: HS256, secret_file: /nonexistent/k").encode(),
            f"{VERIFY}.secret_file",
            "cannot read",
        ),
        # Before any file is opened (open() would raise ValueError, not OSError).
        (
            b'control: {socket: "tcp://127.0.0.1:7001", secret_file: "/run/a\\0b"}',
            "control.secret_file",
            "must not contain a NUL character",
        ),
        (b'state: {path: "/var/lib/router\\0"}', "state.path", "NUL"),
        # A secret's text, read from its file: spawned workers get it in their environment.
        (
            b'control: {socket: "tcp://127.0.0.1:7001", secret_file: "SECRET_WITH_NUL"}',
            "control.secret_file",
            "must not contain a NUL byte",
        ),
        (b'control: {socket: "unix:/run/r\\0.sock"}', "control.socket", "NUL"),
    ],
)
def test_load_config_errors_start_with_the_path(
    tmp_path: Path, content: bytes, key_path: str, reason: str
) -> None:
    config_file = tmp_path / "router.yaml"
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"sixteen-bytes-at-least\0and-more")
    config_file.write_bytes(content.replace(b"SECRET_WITH_NUL", str(secret_file).encode()))
    with pytest.raises(ConfigError) as info:
        load_config(config_file)
    assert str(info.value).startswith(f"{config_file}: {key_path}: ")
    assert reason in info.value.reason


@pytest.mark.parametrize("name", ["missing.yaml", "."])
def test_load_config_unreadable_path(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.source, info.value.key_path) == (str(path), "(file)")
    assert str(info.value).startswith(f"{path}: (file): cannot read: ")


def test_spawn_runs_servers_that_never_say_hello_with_their_env_and_folder() -> None:
    config = parse(
        """
        spawn:
          command: /venv/bin/python app.py
          cwd: /srv/{worker_id}
          count: 2
          register: probe
          env:
            NAME: server-{index}
            CONFIG: |
              port: {port}
        """
    )
    assert config.spawn == SpawnConfig(
        "/venv/bin/python app.py",
        2,
        9001,
        register="probe",
        cwd="/srv/{worker_id}",
        env=(("NAME", "server-{index}"), ("CONFIG", "port: {port}\n")),
    )
    assert parse("spawn: {command: 'srv --port {port}'}").spawn == SpawnConfig("srv --port {port}")


def test_path_prefixes_and_learn_places() -> None:
    config = parse(
        """
        path_prefixes: ["/ng-rollout/{rollout_id}", /v1]
        sessions:
          - name: token
            header: X-Token
            token: {format: raw}
            seed:
              method: POST
              path: /seed
              learn: [{json_pointer: /a/token}, {json_pointer: /b/token}, {header: X-Token}]
          - name: named
            body_field: id
            seed: {method: POST, path: /seed, learn: request}
            close: {method: POST, path: /close}
        """
    )
    assert config.path_prefixes == ("/ng-rollout/{rollout_id}", "/v1")
    token, named = config.sessions
    assert token.seed is not None and token.seed.learn == (
        LearnConfig(json_pointer="/a/token"),
        LearnConfig(json_pointer="/b/token"),
        LearnConfig(header="X-Token"),
    )
    assert named.seed is not None and named.seed.learn == (LearnConfig(request=True),)
    assert named.seed.learns_from_request and not token.seed.learns_from_request


# ---------------------------------------------------------------------------- control bounds


def test_the_control_bounds_are_read_and_checked() -> None:
    config = parse("control: {max_claims_per_worker: 5, max_connections_before_hello: 7}")
    assert config.control.max_claims_per_worker == 5
    assert config.control.max_connections_before_hello == 7
    assert Config().control.max_claims_per_worker == 100_000
    for key, value in [("max_claims_per_worker", 0), ("max_claims_per_worker", 2_000_001)]:
        with pytest.raises(ConfigError) as info:
            parse(f"control: {{{key}: {value}}}")
        assert info.value.key_path == f"control.{key}"
    with pytest.raises(ConfigError) as info:
        parse("control: {max_connections_before_hello: 0}")
    assert info.value.key_path == "control.max_connections_before_hello"


def test_a_control_secret_too_long_for_a_hello_line_is_refused() -> None:
    tcp = "control: {socket: 'tcp://127.0.0.1:7000', secret_env: S}"
    assert parse(tcp, {"S": "s" * 8192}).control.secret == "s" * 8192
    with pytest.raises(ConfigError) as info:
        parse(tcp, {"S": "s" * 8193})
    assert info.value.key_path == "control.secret_env"
    assert "at most 8192 bytes" in info.value.reason


def test_worker_socket_dirs_are_absolute_folders() -> None:
    config = parse("control: {worker_socket_dirs: [/run/workers, /srv/sockets/]}")
    assert config.control.worker_socket_dirs == ("/run/workers", "/srv/sockets/")
    with pytest.raises(ConfigError) as info:
        parse("control: {worker_socket_dirs: [run/workers]}")
    assert info.value.key_path == "control.worker_socket_dirs[0]"


def test_a_static_worker_at_the_control_socket_is_refused() -> None:
    text = """
        control: {socket: 'unix:/run/r/control.sock'}
        workers: [{id: s0, url: 'unix:/run/r/./control.sock'}]
    """
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert (info.value.key_path, info.value.reason) == (
        "workers[0].url",
        "is the router's own control.socket",
    )


def test_a_config_path_that_is_not_a_regular_file_is_refused_without_blocking(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "router.yaml"
    os.mkfifo(fifo)  # no writer: a blocking open or read would wait for ever
    cases = [(fifo, "a FIFO"), (tmp_path, "a directory"), (Path("/dev/null"), "a character device")]
    for path, kind in cases:
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert (info.value.key_path, info.value.reason) == (
            "(file)",
            f"cannot read: not a regular file ({kind})",
        )


def test_a_secret_file_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "token.secret"
    os.mkfifo(fifo)
    config_file = tmp_path / "router.yaml"
    config_file.write_text(verify(f"alg: HS256, secret_file: '{fifo}'"), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(config_file)
    assert "not a regular file (a FIFO)" in info.value.reason


def test_the_control_connection_cap_is_read() -> None:
    assert parse("control: {max_connections: 9}").control.max_connections == 9
    assert Config().control.max_connections == 4096
    with pytest.raises(ConfigError) as info:
        parse("control: {max_connections: 0}")
    assert info.value.key_path == "control.max_connections"
