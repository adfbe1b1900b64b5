"""The text of a request head's bytes (pure): method, target, Host, version."""

from __future__ import annotations

import pytest

from router.edge.head_text import HTTP_11, host_text, method_text, target_of, version_of


@pytest.mark.parametrize(
    ("text", "version"),
    [("1.1", (1, 1)), ("1.0", (1, 0)), ("0.9", (0, 9)), ("2.0", (2, 0))],
)
def test_a_version_is_its_numbers(text: str, version: tuple[int, int]) -> None:
    assert version_of(text) == version


def test_http_11_compares_as_the_version_it_names() -> None:
    assert version_of("1.1") == HTTP_11
    assert version_of("1.0") < HTTP_11 <= version_of("2.0")


def test_a_host_is_read_afresh_whenever_its_bytes_change() -> None:
    hosts = [b"a.example:8080", b"a.example:8080", b"b.example", b"[::1]:81", b"a.example:8080"]
    assert [host_text(host) for host in hosts] == [host.decode() for host in hosts]


@pytest.mark.parametrize(
    "value", [b"a b", b"a\tb", b"a.example/x", b"a@b", b"\xffodd", b'"a"', b"a?b", b"a#b"]
)
def test_a_host_value_that_is_no_host_is_none(value: bytes) -> None:
    assert host_text(b"a.example") == "a.example"
    assert host_text(value) is None
    assert host_text(b"a.example") == "a.example"  # what was cached stands


def test_a_method_is_read_afresh_whenever_its_bytes_change() -> None:
    methods = [b"POST", b"POST", b"GET", b"MKCOL", b"GET", b"PATCH"]
    assert [method_text(method) for method in methods] == [m.decode() for m in methods]


@pytest.mark.parametrize(
    ("url", "target", "authority"),
    [
        (b"/run?x=1", "/run?x=1", None),
        (b"http://a.example:81/run?x=1", "/run?x=1", "a.example:81"),
        (b"http://a.example:81?x=1", "/?x=1", "a.example:81"),
        (b"http://user@a.example/", "/", "a.example"),
        (b"/caf%C3%A9", "/caf%C3%A9", None),
        (b"*", "*", None),
    ],
)
def test_a_target_is_its_origin_form_and_authority(
    url: bytes, target: str, authority: str | None
) -> None:
    assert target_of(url) == (target, authority)
    assert target_of(url) == (target, authority)  # the second time, as the last one read


def test_an_authority_is_not_kept_past_a_target_without_one() -> None:
    assert target_of(b"http://a.example/x") == ("/x", "a.example")
    assert target_of(b"/x") == ("/x", None)
    assert target_of(b"http://a.example/x") == ("/x", "a.example")
