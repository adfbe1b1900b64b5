"""Framing the parser lets through and the router refuses (router.edge.framing), pure."""

from __future__ import annotations

import random

import pytest

from router.edge.framing import content_length_number, framing_problem


@pytest.mark.parametrize(
    ("method", "version", "te", "length", "target", "problem"),
    [
        ("POST", (1, 1), [], 5, "/tools/add", None),
        ("POST", (1, 1), ["chunked"], None, "/x", None),
        ("POST", (1, 1), ["Chunked "], None, "/x", None),
        ("GET", (1, 1), [], None, "/x?a=1", None),
        ("GET", (1, 1), [], 0, "/x", None),
        ("POST", (1, 0), ["chunked"], None, "/x", "Transfer-Encoding needs HTTP/1.1."),
        ("POST", (1, 1), ["gzip, chunked"], None, "/x", "Only Transfer-Encoding: chunked"),
        ("POST", (1, 1), ["gzip", "chunked"], None, "/x", "Only Transfer-Encoding: chunked"),
        ("POST", (1, 1), ["chunked, chunked"], None, "/x", "Only Transfer-Encoding: chunked"),
        ("GET", (1, 1), [], 3, "/x", "A GET request carries no body here."),
        ("HEAD", (1, 1), ["chunked"], None, "/x", "A HEAD request carries no body here."),
        ("GET", (1, 1), [], None, "/a#/../b", "A request target has no fragment (#)."),
        ("CONNECT", (1, 1), [], None, "worker:443", "CONNECT is not forwarded"),
        ("OPTIONS", (1, 1), [], None, "*", "The asterisk form (OPTIONS *)"),
        ("OPTIONS", (1, 1), [], None, "/x", None),
        ("GET", (1, 0), [], None, "/x", None),
        ("GET", (0, 9), [], None, "/x", None),
        ("GET", (2, 0), [], None, "/x", "HTTP versions above 1.1 are not served"),
        ("GET", (1, 2), [], None, "/x", "HTTP versions above 1.1 are not served"),
    ],
)
def test_framing_problems(
    method: str,
    version: tuple[int, int],
    te: list[str],
    length: int | None,
    target: str,
    problem: str | None,
) -> None:
    found = framing_problem(method, version, te, length, target)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem)


@pytest.mark.parametrize(
    "value",
    # llhttp lets through only digits; from " 16" on they go to int(), as before.
    [
        b"0",
        b"16",
        b"007",
        b"1048576",
        b"9" * 18,
        b"9" * 19,
        b"1" * 40,
        b" 16",
        b"16\t",
        b"-1",
        b"+1",
        b"1_0",
    ],
)
def test_a_content_length_reads_as_int_reads_it(value: bytes) -> None:
    assert content_length_number(value) == int(value)


@pytest.mark.parametrize("value", [b"", b"1a", b"1 2", b"0x10", b"\xd9\xa1"])
def test_a_content_length_that_is_no_number_fails_as_int_fails(value: bytes) -> None:
    with pytest.raises(ValueError):
        int(value)
    with pytest.raises(ValueError):
        content_length_number(value)


def test_content_lengths_read_as_int_reads_them_for_any_digits() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        value = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 25))).encode()
        assert content_length_number(value) == int(value)
