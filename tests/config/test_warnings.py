"""Pure tests for router.config.warnings: what a valid config likely gets wrong."""

from __future__ import annotations

from textwrap import dedent

from router.config import config_warnings, parse_config


def warnings_of(text: str, env: dict[str, str] | None = None) -> list[str]:
    return config_warnings(parse_config(dedent(text), source="router.yaml", env=env or {}))


def test_a_plain_config_has_no_warning() -> None:
    assert warnings_of("") == []
    assert (
        warnings_of(
            """
        path_prefixes: ["/ng-rollout/{rollout_id}"]
        sessions:
          - name: resources
            cookie: {name: S___c}
            seed: {method: POST, path: /seed_session}
            close: {method: POST, path: /close_session}
          - name: named
            body_field: resources_session_id
            seed: {method: POST, path: /seed_session, learn: request}
            close: {method: POST, path: /close_session}
        """
        )
        == []
    )


def test_a_seed_that_learns_a_cookie_its_kind_never_reads() -> None:
    [warning] = warnings_of(
        """
        sessions:
          - name: resources
            cookie: {name: SimpleWeatherResourcesServer___single_tool}
            seed: {method: POST, path: /seed, learn: {cookie: ResourcesServer___resources}}
        """
    )
    assert warning.startswith("sessions[0] (resources): the seed learns cookie")
    assert "never read back" in warning


def test_unclaimed_forward_before_several_workers() -> None:
    text = """
        workers: [{id: a, url: "http://127.0.0.1:9001"}, {id: b, url: "http://127.0.0.1:9002"}]
        sessions: [{name: chat, header: X-Chat, token: {format: raw}, unclaimed: forward}]
        """
    [warning] = warnings_of(text)
    assert "unclaimed: forward with 2 workers" in warning
    one = """
        workers: [{id: a, url: "http://127.0.0.1:9001"}]
        sessions: [{name: chat, header: X-Chat, token: {format: raw}, unclaimed: forward}]
        """
    assert warnings_of(one) == []


def test_a_seed_naming_its_session_without_a_close_route() -> None:
    [warning] = warnings_of(
        """
        sessions:
          - {name: named, body_field: id, seed: {method: POST, path: /seed, learn: request}}
        """
    )
    assert "no close route" in warning and "learned_idle_ttl_s" in warning


def test_an_edge_check_whose_secret_is_the_cookie_name() -> None:
    name = "SimpleWeatherResourcesServer___single_tool"
    text = f"""
        sessions:
          - name: resources
            cookie: {{name: {name}, verify: {{secret_env: SECRET}}}}
            seed: {{method: POST, path: /seed}}
        """
    [warning] = warnings_of(text, {"SECRET": name})
    assert "secret is its own name" in warning
    assert warnings_of(text, {"SECRET": "a-real-secret-of-the-server"}) == []


def test_prefixes_no_route_uses() -> None:
    [warning] = warnings_of('path_prefixes: ["/ng-rollout/{rollout_id}"]')
    assert warning.startswith("path_prefixes: no kind")
