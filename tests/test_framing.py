"""Framing the parser lets through and the router refuses (router.framing), pure."""

from __future__ import annotations

import pytest

from router.framing import framing_problem


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
