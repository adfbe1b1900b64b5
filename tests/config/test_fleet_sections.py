"""Pure tests for the `directory:` and `peer:` sections (design §10), and the peer address
a router advertises: parsed from text, no event loop, no Redis."""

from __future__ import annotations

import pytest

from router.config import Config, ConfigError, parse_config
from router.service.settings import advertised_peer, directory_settings, directory_target

SECRET = "0123456789abcdef0123"
ENV = {"PEER_SECRET": SECRET, "HOSTNAME": "router-7f9c-abcde", "REDIS_PASSWORD": "hunter2"}
PEER = "peer: {listen: 127.0.0.1:9903, secret_env: PEER_SECRET}\n"


def parse(text: str, env: dict[str, str] | None = None) -> Config:
    return parse_config(text, source="t.yaml", env=ENV if env is None else env)


def refused(text: str, env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text, env)
    return info.value


def test_a_fleet_config_with_its_defaults() -> None:
    config = parse_config(
        "directory: {url: redis://127.0.0.1:6379/0}\n" + PEER, source="t.yaml", env=ENV
    )
    directory, peer = config.directory, config.peer
    assert directory is not None and peer is not None
    assert directory.router_id == "router-7f9c-abcde"  # the pod name
    assert (directory.prefix, directory.lease_ttl_s, directory.lookup_timeout_ms) == (
        "episode-router",
        10.0,
        50,
    )
    assert (directory.claim_timeout_s, directory.replicas_to_wait_for) == (2.0, 0)
    assert (peer.host, peer.port, peer.advertise, peer.secret) == ("127.0.0.1", 9903, None, SECRET)
    settings = directory_settings(config, "127.0.0.1:9903")
    assert settings.router_id == "router-7f9c-abcde" and settings.min_replicas == 0
    assert settings.tombstone_ttl_s == config.claims.tombstone_ttl_s
    assert directory_target(config) == "redis://127.0.0.1:6379/0"
    assert not directory.key_prefix and not settings.key_prefixes  # keys are looked up


def test_routers_of_one_host_share_the_port_and_forward_straight_by_default() -> None:
    config = parse("directory: {url: redis://127.0.0.1:6379/0}\n" + PEER)
    assert config.peer is not None and config.peer.direct
    assert not config.listen.reuse_port  # a taken port fails loudly unless asked
    assert directory_settings(config, "127.0.0.1:9903", "boot/1.2/1.3").host == "boot/1.2/1.3"
    off = parse(
        "directory: {url: redis://127.0.0.1:6379/0}\n"
        "peer: {listen: 127.0.0.1:9903, secret_env: PEER_SECRET, direct: false}\n"
        "listen: {host: 0.0.0.0, port: 8080, reuse_port: true}\n"
    )
    assert off.listen.reuse_port
    assert directory_settings(off, "127.0.0.1:9903", "boot/1.2/1.3").host == ""  # no table


def test_key_prefixes_are_turned_on_by_directory_key_prefix() -> None:
    config = parse("directory: {url: redis://127.0.0.1:6379/0, key_prefix: true}\n" + PEER)
    assert config.directory is not None and config.directory.key_prefix
    assert directory_settings(config, "127.0.0.1:9903").key_prefixes


def test_sentinel_waits_for_one_replica_by_default_and_the_password_comes_from_the_env() -> None:
    config = parse_config(
        "directory:\n"
        "  sentinel: {master: mymaster, nodes: ['127.0.0.1:26379', '[::1]:26380']}\n"
        "  router_id: r1\n  password_env: REDIS_PASSWORD\n" + PEER,
        source="t.yaml",
        env=ENV,
    )
    assert config.directory is not None
    assert config.directory.replicas_to_wait_for == 1
    assert config.directory.password == "hunter2"
    target = directory_target(config)
    assert not isinstance(target, str)
    assert (target.master, target.nodes) == ("mymaster", (("127.0.0.1", 26379), ("::1", 26380)))


@pytest.mark.parametrize(
    ("text", "key_path", "reason"),
    [
        ("directory: {url: redis://127.0.0.1:6379/0}\n", "peer", "go together"),
        (PEER, "directory", "go together"),
        ("directory: {}\n" + PEER, "directory", "set one of `url`"),
        (
            "directory: {url: redis://a:1/0, sentinel: {master: m, nodes: ['a:1']}}\n" + PEER,
            "directory",
            "set one of",
        ),
        ("directory: {url: http://a:1}\n" + PEER, "directory.url", "expected redis://"),
        ("directory: {url: 'redis://:pw@a:1/0'}\n" + PEER, "directory.url", "password_env"),
        ("directory: {url: 'unix:relative.sock'}\n" + PEER, "directory.url", "absolute"),
        (
            "directory: {url: redis://a:1/0, router_id: 'a b'}\n" + PEER,
            "directory.router_id",
            "1-128",
        ),
        ("directory: {url: redis://a:1/0, prefix: 'x:y'}\n" + PEER, "directory.prefix", "1-128"),
        (
            "directory: {url: redis://a:1/0, lease_ttl_s: 1}\n" + PEER,
            "directory.lease_ttl_s",
            "1.5",
        ),
        ("directory: {url: redis://a:1/0, password: x}\n" + PEER, "directory.password", "inline"),
        (
            "directory: {url: redis://a:1/0, key_prefix: 'yes'}\n" + PEER,
            "directory.key_prefix",
            "true or false",
        ),
        (
            "directory: {sentinel: {master: m, nodes: []}}\n" + PEER,
            "directory.sentinel.nodes",
            "at least one",
        ),
        (
            "directory: {sentinel: {master: m, nodes: ['nohost']}}\n" + PEER,
            "directory.sentinel.nodes[0]",
            "host:port",
        ),
        ("directory: {url: redis://a:1/0}\npeer: {listen: 127.0.0.1:9903}\n", "peer", "signed"),
        (
            "directory: {url: redis://a:1/0}\npeer: {listen: nowhere, secret_env: PEER_SECRET}\n",
            "peer.listen",
            "host:port",
        ),
        (
            "directory: {url: redis://a:1/0}\n"
            "peer: {listen: 127.0.0.1:8080, secret_env: PEER_SECRET}\n"
            "listen: {host: 127.0.0.1, port: 8080}\n",
            "peer.listen",
            "clashes",
        ),
        (
            "directory: {url: redis://a:1/0}\npeer: {listen: 127.0.0.1:9903, secret: x}\n",
            "peer.secret",
            "inline",
        ),
        (
            "directory: {url: redis://a:1/0}\n"
            "peer: {listen: 127.0.0.1:9903, secret_env: PEER_SECRET, direct: 1}\n",
            "peer.direct",
            "true or false",
        ),
        ("listen: {port: 8080, reuse_port: 1}\n", "listen.reuse_port", "true or false"),
    ],
)
def test_what_a_fleet_config_gets_wrong_is_named(text: str, key_path: str, reason: str) -> None:
    error = refused(text)
    assert error.key_path == key_path, error
    assert reason in error.reason, error


def test_a_short_peer_secret_is_refused() -> None:
    error = refused("directory: {url: redis://a:1/0}\n" + PEER, {**ENV, "PEER_SECRET": "short"})
    assert error.key_path == "peer.secret_env" and "at least 16" in error.reason


def test_a_null_router_id_is_the_pod_name() -> None:
    config = parse("directory: {url: redis://a:1/0, router_id: null}\n" + PEER)
    assert config.directory is not None and config.directory.router_id == "router-7f9c-abcde"


def test_the_router_id_falls_back_to_the_host_name_without_hostname() -> None:
    config = parse_config(
        "directory: {url: redis://a:1/0}\n" + PEER, source="t", env={"PEER_SECRET": SECRET}
    )
    assert config.directory is not None and config.directory.router_id


def test_the_advertised_peer_address() -> None:
    def config(listen: str, advertise: str | None = None) -> Config:
        extra = f", advertise: '{advertise}'" if advertise else ""
        return parse_config(
            f"directory: {{url: redis://a:1/0, router_id: r1}}\n"
            f"peer: {{listen: '{listen}', secret_env: PEER_SECRET{extra}}}\n",
            source="t",
            env=ENV,
        )

    assert advertised_peer(config("127.0.0.2:0"), 41234, {}) == "127.0.0.2:41234"
    assert advertised_peer(config("0.0.0.0:9903"), 9903, {"POD_IP": "10.1.2.3"}) == "10.1.2.3:9903"
    assert advertised_peer(config("[::]:9903"), 9903, {"POD_IP": "fd00::5"}) == "[fd00::5]:9903"
    named = config("0.0.0.0:9903", "peer-a.fleet:9903")
    assert advertised_peer(named, 9903, {}) == "peer-a.fleet:9903"
    with pytest.raises(ValueError, match="POD_IP"):
        advertised_peer(config("0.0.0.0:9903"), 9903, {})
