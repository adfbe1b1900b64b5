"""Fuzz target: the forwarding header rules (design §8), fed any header section.

Each input line `name:value` is one client header (or, after a line holding only `--`,
one worker reply header). `request_headers_for_worker` must never pass on a hop-by-hop
header (nor one Connection names), a name with `_`, a Proxy-* header, or a client's
X-Forwarded-*, Forwarded, X-Real-IP, Expect or X-Episode-Router-* value, and must pass
everything else in order; `reply_headers_for_client` must drop the hop-by-hop ones and
keep the rest in order; `rewrite_location` must never raise. Anything else is a finding.

Coverage-guided, with atheris (libFuzzer flags; crashes are written as `crash-*` files
in the working directory unless `-artifact_prefix=` says otherwise):

    python fuzz/fuzz_headers.py -runs=100000 [corpus_dir ...]

An empty corpus directory is first filled with the seeds below; without one, a folder in
the system's temporary directory is used (and kept for later runs). Without atheris,
`python fuzz/fuzz_headers.py --replay [file ...]` runs the seeds (and the files) once.
"""

from __future__ import annotations

import sys

from fuzz_harness import instrumented, run

with instrumented():
    from router.relay.contract import (
        reply_headers_for_client,
        request_headers_for_worker,
        rewrite_location,
    )

NAME = "headers"
WORKER = "127.0.0.1:9001"
PRIVATE = f"http://{WORKER}"
PUBLIC = "http://router.example:8080"
EXTRA = {"X-Episode-Router-Boot": "boot-1"}
HOP_BY_HOP = {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
OWNED = {"host", "forwarded", "x-real-ip", "expect"}
OWNED_PREFIXES = ("x-forwarded-", "x-episode-router-", "proxy-")
ADDED = {"host", "x-forwarded-host", "x-forwarded-for", "x-forwarded-proto"}
Headers = list[tuple[str, str]]


def headers_of(text: str) -> Headers:
    return [(n, v) for n, _, v in (line.partition(":") for line in text.split("\n")) if n]


def listed(headers: Headers) -> set[str]:
    """The names every Connection header lists, lower-cased."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
    }


def check_request(client: Headers) -> None:
    out = request_headers_for_worker(
        client, worker_host=WORKER, client_ip="10.0.0.7", scheme="https", extra=EXTRA
    )
    named = listed(client)
    chunked = any(name.lower() == "transfer-encoding" for name, _ in client)
    relayed = [(n, v) for n, v in out.items() if n.lower() not in ADDED | {"x-episode-router-boot"}]
    for name, _ in relayed:
        lower = name.lower()
        assert "_" not in lower and lower not in HOP_BY_HOP | named | OWNED, (name, client)
        assert not lower.startswith(OWNED_PREFIXES), (name, client)
    assert out.getall("Host") == [WORKER] and out.getall("X-Forwarded-For") == ["10.0.0.7"]
    assert out.getall("X-Forwarded-Proto") == ["https"], out
    assert out.getall("X-Episode-Router-Boot") == ["boot-1"], out
    hosts = [value for name, value in client if name.lower() == "host"]
    assert out.getall("X-Forwarded-Host", []) == hosts[:1], out
    kept = [
        (n, v)
        for n, v in client
        if not _stripped(n.lower(), named) and not (chunked and n.lower() == "content-length")
    ]
    assert relayed == kept, (client, out)


def _stripped(lower: str, named: set[str]) -> bool:
    return "_" in lower or lower in HOP_BY_HOP | named | OWNED or lower.startswith(OWNED_PREFIXES)


def check_reply(worker: Headers) -> None:
    out = reply_headers_for_client(worker, private_origin=PRIVATE, public_base=PUBLIC)
    named = listed(worker)
    hop = [
        (n, v)
        for n, v in worker
        if n.lower() in HOP_BY_HOP | named or n.lower().startswith("proxy-")
    ]
    assert not any((n, v) in hop for n, v in out), (worker, out)
    assert [n for n, _ in out] == [n for n, v in worker if (n, v) not in hop], out
    for name, value in worker:
        rewritten = rewrite_location(value, PRIVATE, PUBLIC)
        assert rewritten == value or rewritten.startswith(PUBLIC), (name, value, rewritten)


def check(data: bytes) -> None:
    """One input, decoded as header bytes are: UTF-8 with surrogate escapes."""
    text = data.decode("utf-8", "surrogateescape")
    request, _, reply = text.partition("\n--\n")
    check_request(headers_of(request))
    check_reply(headers_of(reply))


def seeds() -> list[bytes]:
    """Header sections with every rule in play."""
    request = "\n".join(
        [
            "Host:public.example",
            "Connection:keep-alive, X-Private",
            "X-Private:secret",
            "Keep-Alive:timeout=5",
            "Transfer-Encoding:chunked",
            "Content-Length:10",
            "Content_Length:5",
            "X-Forwarded-For:6.6.6.6",
            "Forwarded:for=6.6.6.6",
            "X-Episode-Router-Boot:forged",
            "Proxy-Authorization:Basic x",
            "Cookie:a=1",
            "X-NeMo-Gym-Episode-Token:a.b.c",
        ]
    )
    reply = "\n".join(
        [
            f"Location:{PRIVATE}/next",
            f"Content-Location:{PRIVATE}",
            "Connection:X-Reply-Private",
            "X-Reply-Private:1",
            "Set-Cookie:a=1",
            "Set-Cookie:b=2",
        ]
    )
    return [
        f"{request}\n--\n{reply}".encode(),
        b"Host:a\nHost:b\n--\nLocation:http://127.0.0.1:90011/x",
    ]


def main(argv: list[str]) -> int:
    """Fuzz with atheris, or with --replay run the seeds and the given files once."""
    return run(argv, NAME, check, seeds)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
