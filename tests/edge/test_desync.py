"""The public listener against http-desync-guardian's request-classification corpus (design §8).

Every case of the corpus's YAML files is sent, as raw bytes on a new connection, to a
router in this process with one echo worker, and what happened is judged by the case's
tier, as the corpus's README asks of a proxy:

- Severe: the router's own 400 answer and a closed client connection; the worker never
  sees the request.
- Ambiguous: refused as above, or forwarded with the client connection closed after the
  reply and the router's connection to the worker closed too (not kept in its pool).
- Compliant and Acceptable: forwarded intact. The worker sees what it sees when the same
  bytes are sent to it directly (method, path and query, body length), less only what the
  router strips by design: hop-by-hop headers (and those Connection names), names with
  `_`, and the headers the router owns (Host, Forwarded, X-Real-IP, Expect,
  X-Forwarded-*, X-Episode-Router-*). Transfer codings the sender applied must not vanish.

How a case becomes bytes: `METHOD SP URI SP VERSION CRLF` (no `SP VERSION` when the
version is empty: HTTP/0.9), then one `name: value CRLF` line per header in the case's
order, then `Host: desync.test` when the case has no Host (HTTP/1.1 requires one, and a
request without it is refused before anything the case is about is looked at; it goes
last so that a case whose first header line starts with whitespace still follows the
request line), then CRLF. A code point up to U+00FF is the single octet the corpus's
`\\xNN` escapes stand for; anything above is UTF-8. A body is added when the case implies
one: a chunked `hello` when a Transfer-Encoding header's last coding is chunked,
otherwise as many bytes as the first Content-Length header that is a plain decimal
number says (up to 8 MiB).

How the connections are checked: the client's by sending a further request after the
reply (a kept-alive connection answers it, a closed one ends); the router's connection
to the worker in the kernel's TCP table (an established socket on the worker's port
after the reply means the router kept it).

`DIFFERS` lists the cases where the router departs from the corpus's verdict in a way
that is defensible, with the behaviour the test expects and why. `BUGS` lists the router
bugs the corpus found; each has an xfail(strict=True) test of its own, which starts
passing (and so fails) once the bug is fixed. One more such test holds the body limit to
chunked bodies (a gap found beside the corpus, not by it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import LimitsConfig
from tests.router_fixtures import WAIT_S, EchoWorker, RawHttp, Rig, Seen, open_rig, router_config

# The corpus is Apache-2.0 test data, kept in the repository with its LICENSE, NOTICE and SOURCE.
CORPUS_DIR = Path(__file__).resolve().parents[1] / "corpora" / "http-desync-guardian"
TIERS = ("Severe", "Ambiguous", "Acceptable", "Compliant")
HOST = "desync.test"
PROBE_PATH = "/desync-probe"
PROBE = f"GET {PROBE_PATH} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
CHUNKED_BODY = b"5\r\nhello\r\n0\r\n\r\n"
MAX_CASE_BODY = 8 << 20  # a Content-Length above this is never sent (one case says 2**64)
SETTLE_S = 0.1  # how long a closed worker connection may take to leave the kernel's table

# design §8: what the router never passes on from a client's request.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
)
ROUTER_OWNED = frozenset({"host", "forwarded", "x-real-ip", "expect"})
ROUTER_OWNED_PREFIXES = ("x-forwarded-", "x-episode-router-", "proxy-")
FRAMING = frozenset({"content-length", "transfer-encoding"})  # re-framed: compared as a body
# What the router adds to every forwarded request.
ROUTER_SET = frozenset(
    {"host", "x-forwarded-host", "x-forwarded-for", "x-forwarded-proto", "x-episode-router-boot"}
)

CaseKey = tuple[str, str, str]  # (YAML file stem, case name, method): unique in the corpus


# --- the corpus -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    """One corpus case, as its YAML file states it."""

    file: str
    name: str
    method: str
    uri: str
    version: str
    headers: tuple[tuple[str, str], ...]
    tier: str

    @property
    def key(self) -> CaseKey:
        return (self.file, self.name, self.method)

    @property
    def label(self) -> str:
        return f"{self.file}: {self.name!r} ({self.method}, {self.tier})"


def load_corpus() -> list[Case]:
    """Every case of every YAML file in the corpus; fails the test when it is missing."""
    if not CORPUS_DIR.is_dir():
        pytest.fail(
            f"the http-desync-guardian corpus is missing: expected it at {CORPUS_DIR} "
            "(tests/corpora/http-desync-guardian in the repository)"
        )
    cases = _read_corpus()
    if not cases:
        pytest.fail(f"the http-desync-guardian corpus at {CORPUS_DIR} has no cases")
    return list(cases)


@functools.cache
def _read_corpus() -> tuple[Case, ...]:
    return tuple(case for path in sorted(CORPUS_DIR.glob("*.yaml")) for case in _cases_of(path))


def _cases_of(path: Path) -> list[Case]:
    cases = []
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when it is there
    for entry in yaml.load(path.read_text(encoding="utf-8"), Loader=loader):
        headers = tuple((str(h["name"]), str(h["value"])) for h in entry.get("headers") or ())
        tier = str(entry["expected"]["tier"])
        assert tier in TIERS, f"{path.name}: {entry['name']!r} has an unknown tier {tier!r}"
        version = str(entry.get("version") or "")
        method, uri = str(entry["method"]), str(entry["uri"])
        cases.append(Case(path.stem, str(entry["name"]), method, uri, version, headers, tier))
    return cases


def corpus_case(key: CaseKey) -> Case:
    found = [case for case in load_corpus() if case.key == key]
    if len(found) != 1:
        pytest.fail(f"{key} names {len(found)} corpus cases, not one")
    return found[0]


# --- the bytes on the wire ----------------------------------------------------------------------


def wire(text: str) -> bytes:
    """The octets a corpus string stands for: U+0000..U+00FF as one byte, the rest as UTF-8."""
    return b"".join(c.encode("latin-1") if ord(c) < 256 else c.encode() for c in text)


def request_bytes(case: Case) -> bytes:
    """The whole request a case describes (see the module docstring)."""
    line = wire(case.method) + b" " + wire(case.uri)
    if case.version:
        line += b" " + wire(case.version)
    lines = [line, *(wire(name) + b": " + wire(value) for name, value in case.headers)]
    if not any(name.lower() == "host" for name, _ in case.headers):
        lines.append(b"Host: " + HOST.encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + case_body(case)


def transfer_codings(case: Case) -> list[str]:
    """The codings of every header named Transfer-Encoding, in order, lower-cased."""
    return [
        item.split(";")[0].strip(" \t").lower()
        for name, value in case.headers
        if name.lower() == "transfer-encoding"
        for item in value.split(",")
    ]


def case_body(case: Case) -> bytes:
    codings = transfer_codings(case)
    if codings and codings[-1] == "chunked":
        return CHUNKED_BODY
    for name, value in case.headers:
        if name.lower() == "content-length":
            digits = value.strip(" \t")
            if digits.isascii() and digits.isdigit() and int(digits) <= MAX_CASE_BODY:
                return b"x" * int(digits)
            return b""
    return b""


# --- what happened ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A request as the echo worker took it: what it recorded, and its reply."""

    seen: Seen | None  # None: its handler never ran (its own router refused the path)
    status: int | None
    body: bytes

    @property
    def echoed_path(self) -> str | None:
        """The path and query the worker echoed (a HEAD reply has no body to echo it)."""
        try:
            value = json.loads(self.body).get("path")
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one case did to the router, its client connection and its worker."""

    status: int | None  # None: the connection ended before a reply head
    router_code: str | None  # the `error` of the router's own answer
    client_closed: bool
    worker_kept: bool | None  # measured for forwarded Severe and Ambiguous cases
    routed: WorkerView | None
    direct: WorkerView | None  # the same bytes sent to the worker itself

    @property
    def forwarded(self) -> bool:
        return self.status is not None and self.router_code is None

    @property
    def refused(self) -> bool:
        return (
            self.status == 400
            and self.router_code == "bad_request"
            and self.client_closed
            and self.routed is None
        )

    @property
    def behaviour(self) -> str:
        """A short name for what the router did: `refused`, or `forwarded, ...`."""
        if self.refused:
            return "refused"
        if not self.forwarded:
            return f"answered {self.status} {self.router_code} (closed: {self.client_closed})"
        parts = ["forwarded", f"client {'closed' if self.client_closed else 'kept'}"]
        if self.worker_kept is not None:
            parts.append(f"worker {'kept' if self.worker_kept else 'closed'}")
        return ", ".join(parts)


RawReply = tuple[int, dict[str, str], bytes]  # status, headers (lower-cased), body


async def read_reply(conn: RawHttp, method: str) -> RawReply | None:
    """The next reply on `conn`, or None when the connection ends first."""
    try:
        status, headers, _ = await conn.read_head()
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    assert "transfer-encoding" not in headers, f"a chunked reply was not expected: {headers}"
    length = int(headers.get("content-length", "0"))
    try:
        # A reply to HEAD has no body, except the router's answer to a head it could not
        # parse (it never knew the method): that one comes at once, with the head.
        timeout = SETTLE_S if method == "HEAD" else WAIT_S
        body = await asyncio.wait_for(conn.reader.readexactly(length), timeout)
    except TimeoutError:
        if method != "HEAD":
            raise
        body = b""
    except asyncio.IncompleteReadError as ended:
        if method != "HEAD":
            raise
        body = ended.partial  # a HEAD answer without a body, then the connection closed
    return status, headers, body


def router_code_of_bodyless(headers: dict[str, str], status: int | None) -> str | None:
    """For a bodyless reply the worker never saw: the router's answer by its status."""
    if headers.get("content-type") != "application/json" or status is None:
        return None
    return {400: "bad_request", 401: "unknown_episode", 503: "no_worker"}.get(status)


def router_code(headers: dict[str, str], body: bytes) -> str | None:
    """The code of the router's own JSON answer (design §1), None for a worker's reply."""
    if headers.get("content-type") != "application/json":
        return None
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if not isinstance(answer, dict) or set(answer) != {"error", "detail", "session"}:
        return None
    code = answer["error"]
    return code if isinstance(code, str) else None


async def closed_after_reply(conn: RawHttp) -> bool:
    """True when the peer closed the connection: a further request gets no reply."""
    conn.send(PROBE)
    try:
        first = await asyncio.wait_for(conn.reader.read(1), WAIT_S)
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return first == b""


def established_on(port: int) -> int:
    """Established TCP connections whose local end is loopback `port`, per the kernel."""
    count = 0
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            count += 1
    return count


async def worker_connection_kept(port: int) -> bool:
    """True when a connection to the worker is still established after SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    while established_on(port):
        if time.monotonic() > deadline:
            return True
        await asyncio.sleep(0.01)
    return False


async def drop_worker_connections(rig: Rig, worker: EchoWorker) -> None:
    """Closes the router's pool to the worker and waits until the kernel shows none open."""
    if not established_on(worker.port):
        return
    rig.router.forwarder.forget(worker.id)
    deadline = time.monotonic() + WAIT_S
    while established_on(worker.port):
        assert time.monotonic() < deadline, "the router's pooled worker connections stay open"
        await asyncio.sleep(0.002)


async def send_to(port: int, data: bytes, method: str) -> tuple[RawHttp, RawReply | None]:
    conn = await RawHttp.open(port)
    conn.send(data)
    return conn, await read_reply(conn, method)


def seen_since(worker: EchoWorker, start: int) -> Seen | None:
    seen = [s for s in worker.seen[start:] if s.path != PROBE_PATH]
    assert len(seen) <= 1, f"the worker saw {len(seen)} requests for one case"
    return seen[0] if seen else None


async def run_case(rig: Rig, worker: EchoWorker, case: Case) -> Outcome:
    """Send one case through the router (and, when it was forwarded, to the worker itself)."""
    measure_worker = case.tier in ("Severe", "Ambiguous")
    if measure_worker:
        await drop_worker_connections(rig, worker)  # so a connection left after it is its own
    data = request_bytes(case)
    start = len(worker.seen)
    conn, reply = await send_to(rig.router.public_port, data, case.method)
    try:
        status, headers, body = reply if reply is not None else (None, {}, b"")
        code = router_code(headers, body)
        seen = seen_since(worker, start)
        # A reply to HEAD has no body, so the router's own answer shows only in its
        # headers; the worker never having seen the request tells them apart.
        if code is None and case.method == "HEAD" and seen is None:
            code = router_code_of_bodyless(headers, status)
        forwarded = status is not None and code is None
        routed = WorkerView(seen, status, body) if seen is not None or forwarded else None
        kept = await worker_connection_kept(worker.port) if forwarded and measure_worker else None
        closed = await closed_after_reply(conn)
    finally:
        conn.close()
    direct = await direct_view(worker, data, case.method) if forwarded else None
    return Outcome(status, code, closed, kept, routed, direct)


async def direct_view(worker: EchoWorker, data: bytes, method: str) -> WorkerView:
    """What the worker makes of the same bytes sent to it with no router in between."""
    start = len(worker.seen)
    conn, reply = await send_to(worker.port, data, method)
    conn.close()
    status, body = (reply[0], reply[2]) if reply is not None else (None, b"")
    return WorkerView(seen_since(worker, start), status, body)


# --- the verdicts -------------------------------------------------------------------------------


def connection_named(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    return frozenset(
        token.strip(" \t").lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
    )


def passed_on(name: str, named: frozenset[str]) -> bool:
    """Whether design §8 lets a client's header reach the worker as the client sent it."""
    lower = name.lower()
    return not (
        "_" in lower
        or lower in HOP_BY_HOP
        or lower in named
        or lower in ROUTER_OWNED
        or lower in FRAMING
        or lower.startswith(ROUTER_OWNED_PREFIXES)
    )


def intact_problem(case: Case, routed: WorkerView, direct: WorkerView) -> str | None:
    """Why the worker's view through the router is not its direct view (less the rules)."""
    if routed.seen is None or direct.seen is None:
        # The echo worker's catch-all route does not match a decoded path with a newline,
        # so its own 404 is all there is to compare, either way.
        routed_reply, direct_reply = (routed.status, routed.body), (direct.status, direct.body)
        same = routed.seen is direct.seen is None and routed_reply == direct_reply
        return None if same else f"the worker answered {routed.status}, directly {direct.status}"
    got, want = routed.seen, direct.seen
    if (got.method, got.path, got.body_bytes) != (want.method, want.path, want.body_bytes):
        return (
            f"the worker saw {got.method} {got.path!r} with {got.body_bytes} body bytes, "
            f"directly {want.method} {want.path!r} with {want.body_bytes}"
        )
    if routed.echoed_path != direct.echoed_path:
        return f"the worker saw the target {routed.echoed_path!r}, directly {direct.echoed_path!r}"
    named = connection_named(want.headers)
    expected = Counter((n.lower(), v) for n, v in want.headers if passed_on(n, named))
    relayed = Counter(
        (n.lower(), v) for n, v in got.headers if n.lower() not in ROUTER_SET | FRAMING
    )
    if relayed != expected:
        missing, extra = sorted(expected - relayed), sorted(relayed - expected)
        return f"headers differ: missing {missing}, not sent by the client {extra}"
    forwarded_for = [v for n, v in got.headers if n.lower() == "x-forwarded-for"]
    if forwarded_for != ["127.0.0.1"]:
        return f"X-Forwarded-For is {forwarded_for}, not the client's address alone"
    applied = [c for c in transfer_codings(case) if c not in ("chunked", "identity", "")]
    labels = FRAMING | {"content-encoding"}
    told = " ".join(v.lower() for n, v in got.headers if n.lower() in labels)
    if any(coding not in told for coding in applied):
        return f"the transfer codings {applied} vanished: the worker got a coded body unlabelled"
    return None


def rule_problem(case: Case, outcome: Outcome) -> str | None:
    """Why `outcome` breaks the corpus's rule for the case's tier; None when it keeps it."""
    if outcome.forwarded:
        assert outcome.routed is not None and outcome.direct is not None
        problem = intact_problem(case, outcome.routed, outcome.direct)
        if problem is not None:
            return f"forwarded, but not intact: {problem}"
    if case.tier == "Severe":
        return None if outcome.refused else f"{outcome.behaviour}, not refused"
    if case.tier == "Ambiguous":
        if outcome.refused or outcome.behaviour == "forwarded, client closed, worker closed":
            return None
        return f"{outcome.behaviour}: neither refused nor forwarded with both connections closed"
    return None if outcome.forwarded else f"{outcome.behaviour}, not forwarded"


# --- where the router departs from the corpus -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Differs:
    """A defensible departure from the corpus's verdict: what the router does, and why."""

    behaviour: str
    reason: str


_WS_BEFORE_COLON = "RFC 9112 §5.1: whitespace between a field name and its colon MUST get a 400"
_NOT_A_TOKEN = "a field name must be a token (RFC 9110 §5.1); the strict parser refuses a CTL"
_CTL_IN_VALUE = "RFC 9110 §5.5: a CTL makes a field value invalid, and rejecting it is allowed"
_ONLY_CHUNKED = (
    "repeated Transfer-Encoding lines are refused, not merged, and their codings other than"
    " chunked are ones the router cannot decode (design §8: unknown TE is a 400)"
)
_PLAIN_CHUNKED_ONLY = (
    "like nginx, only `Transfer-Encoding: chunked` is accepted: the parser undoes the chunking"
    " only, so another coding would reach the worker still applied with nothing saying so"
)
_NO_FRAGMENT = (
    "a request-target has no fragment (RFC 9112 §3.2); the router and a worker would read"
    " what follows `#` differently, so such a target is refused"
)
_REFRAMED = (
    "the client connection is closed; the worker gets the body re-framed by the router"
    " (its own chunked or Content-Length framing), so its pooled connection stays in step"
)
_DROPPED = (
    "a name with `_` is dropped (design §8), the body is framed by the real headers alone,"
    " so nothing behind the router reads the look-alike as framing"
)

DIFFERS: dict[CaseKey, Differs] = {
    # Compliant cases the router refuses on purpose (router/edge/framing.py).
    ("more-compliant-tests", "Correct TE OK", "POST"): Differs("refused", _PLAIN_CHUNKED_ONLY),
    ("more-compliant-tests", "Transfer-Encoding: identity and chunked OK", "POST"): Differs(
        "refused", _PLAIN_CHUNKED_ONLY
    ),
    ("rfc-compliant", "Different Transfer-Encoding headers combined", "POST"): Differs(
        "refused", _PLAIN_CHUNKED_ONLY
    ),
    ("rfc-compliant", "Compliant URL", "POST"): Differs("refused", _NO_FRAGMENT),
    # Compliant and Acceptable cases the strict parser refuses.
    ("acceptable", "No TE/CL headers, some others are non-compliant", "PUT"): Differs(
        "refused", _WS_BEFORE_COLON
    ),
    ("acceptable", "TE and some others are non-compliant", "PUT"): Differs(
        "refused", _WS_BEFORE_COLON
    ),
    ("acceptable", "CL and some others are non-compliant", "PUT"): Differs(
        "refused", _WS_BEFORE_COLON
    ),
    ("acceptable", "A non-essential header with a non-printable character (x01)", "PUT"): (
        Differs("refused", _NOT_A_TOKEN)
    ),
    ("bad-header-characters", "Some-Header\\x01", "POST"): Differs("refused", _NOT_A_TOKEN),
    ("bad-header-characters", "\\x01Some-Header", "POST"): Differs("refused", _NOT_A_TOKEN),
    ("bad-header-characters", "Some-Header: \\x01value", "POST"): Differs("refused", _CTL_IN_VALUE),
    ("bad-header-characters", "Some-Header: value\\x01", "POST"): Differs("refused", _CTL_IN_VALUE),
    ("acceptable", "Unknown but OK HTTP/1.2", "GET"): Differs(
        "refused", "RFC 9110 §2.5 SHOULD read 1.2 as 1.1; the parser refuses unknown versions"
    ),
    ("uri-specific-test-cases", "Extra spaces in version", "GET"): Differs(
        "refused", "`HTTP/1.1 ` is not a request-line (RFC 9112 §3); a 400 is the SHOULD"
    ),
    ("uri-specific-test-cases", "[space] in URI", "GET"): Differs(
        "refused", "RFC 9112 §3.2: whitespace in a request-target SHOULD get a 400, not a repair"
    ),
    ("rfc-compliant", "International in URI", "GET"): Differs(
        "refused", "raw non-ASCII octets are not a URI (RFC 3986 §2); clients percent-encode"
    ),
    ("rfc-compliant", "Empty URI", "GET"): Differs(
        "refused", "a request-line with no request-target is not HTTP (RFC 9112 §3)"
    ),
    ("rfc-compliant", "Different Transfer-Encoding headers", "POST"): Differs(
        "refused", _ONLY_CHUNKED
    ),
    ("rfc-compliant", "Transfer-Encoding with a param: chunked;custom_param", "POST"): Differs(
        "refused", _ONLY_CHUNKED
    ),
    ("more-compliant-tests", "Multiple transfer encoding headers in a single request OK", "POST"): (
        Differs("refused", _ONLY_CHUNKED)
    ),
    ("more-compliant-tests", "TE with custom parameters OK", "POST"): Differs(
        "refused", "chunked takes no parameters (RFC 9112 §7.1); the parser refuses one"
    ),
    # Ambiguous cases forwarded on connections the router keeps.
    ("ambiguous", "Transfer_Encoding with underscore.", "POST"): Differs(
        "forwarded, client kept, worker kept", _DROPPED
    ),
    ("ambiguous", "Content_Length with underscore.", "POST"): Differs(
        "forwarded, client kept, worker kept", _DROPPED
    ),
    ("ambiguous", "Transfer-Encoding with multiple delimiters", "POST"): Differs(
        "forwarded, client kept, worker kept", _DROPPED
    ),
    ("ambiguous", "Transfer-Encoding with multiple hyphens", "POST"): Differs(
        "forwarded, client kept, worker kept",
        "`Transfer---Encoding` is a distinct, valid name that no stack reads as framing"
        " (CGI makes it HTTP_TRANSFER___ENCODING); the router frames the body itself",
    ),
    ("ambiguous", "Content-Length for HTTP/0.9", "POST"): Differs(
        "forwarded, client closed, worker kept", _REFRAMED
    ),
    ("ambiguous", "Content-Length for empty protocol, which is HTTP/0.9", "POST"): Differs(
        "forwarded, client closed, worker kept", _REFRAMED
    ),
}

# --- router bugs the corpus found ---------------------------------------------------------------


BUGS: dict[CaseKey, str] = {}


# --- the tally ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """Per tier: cases, handled per the rule, listed in DIFFERS, known bugs, failing."""

    rows: dict[str, Counter[str]] = field(default_factory=lambda: {t: Counter() for t in TIERS})

    def count(self, tier: str, column: str) -> None:
        self.rows[tier]["cases"] += 1
        self.rows[tier][column] += 1

    def render(self) -> str:
        columns = ("cases", "handled", "differs", "bug", "failing")
        lines = ["http-desync-guardian corpus, per tier:"]
        lines.append(f"  {'tier':<11}" + "".join(f"{c:>9}" for c in columns))
        total: Counter[str] = Counter()
        for tier, row in self.rows.items():
            total.update(row)
            lines.append(f"  {tier:<11}" + "".join(f"{row[c]:>9}" for c in columns))
        lines.append(f"  {'all':<11}" + "".join(f"{total[c]:>9}" for c in columns))
        return "\n".join(lines)


def judge(case: Case, outcome: Outcome) -> tuple[str, str | None]:
    """(tally column, problem): how the case counts, and what is wrong if anything."""
    problem = rule_problem(case, outcome)
    if case.key in BUGS:
        return "bug", None  # its own xfail test holds it to the rule
    known = DIFFERS.get(case.key)
    if known is None:
        return ("handled", None) if problem is None else ("failing", problem)
    if problem is None:
        return "failing", "handled per the rule now: take it out of DIFFERS"
    if problem.startswith("forwarded, but not intact") or outcome.behaviour != known.behaviour:
        return "failing", f"{problem}; DIFFERS expects {known.behaviour!r}"
    return "differs", None


# --- the tests ----------------------------------------------------------------------------------


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        await rig.start_router()
        await rig.add_worker("w0")
        yield rig


async def test_every_corpus_case_is_handled_as_its_tier_asks(rig: Rig) -> None:
    cases = load_corpus()
    keys = {case.key for case in cases}
    stale = sorted(str(key) for key in (DIFFERS.keys() | BUGS.keys()) - keys)
    assert not stale, f"DIFFERS or BUGS name cases the corpus does not have: {stale}"
    worker = rig.workers["w0"]
    tally = Tally()
    problems = []
    for case in cases:
        outcome = await run_case(rig, worker, case)
        column, problem = judge(case, outcome)
        tally.count(case.tier, column)
        if problem is not None:
            problems.append(f"{case.label}: {problem}")
    report = tally.render()
    print("\n" + report)
    assert not problems, report + "\n" + "\n".join(problems)


def _bug_params() -> list[Any]:
    return [
        pytest.param(
            key,
            id=f"{key[0]}: {key[1]}",
            marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason),
        )
        for key, reason in BUGS.items()
    ]


@pytest.mark.parametrize("key", _bug_params())
async def test_a_known_router_bug_is_still_there(rig: Rig, key: CaseKey) -> None:
    case = corpus_case(key)
    outcome = await run_case(rig, rig.workers["w0"], case)
    problem = rule_problem(case, outcome)
    assert problem is None, f"{case.label}: {problem}\n{BUGS[key]}"


_CHUNKED_OVER_LIMIT = (
    "limits.max_body_bytes is checked against Content-Length only: a chunked body of any"
    " size streams through to the worker. Fix: count the bytes in _Upload.chunks"
    " (forward.py) and fail the forward past the limit, answered 413 payload_too_large"
)


async def test_a_chunked_body_over_the_body_limit_is_refused(tmp_path: Path) -> None:
    """Not a corpus case: design §8's body limit, for the framing the corpus leans on most."""
    async with open_rig(tmp_path) as rig:
        limits = dataclasses.replace(LimitsConfig(), max_body_bytes=10)
        await rig.start_router(router_config(tmp_path, limits=limits))
        await rig.add_worker("w0")
        head = b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn, reply = await send_to(
            rig.router.public_port, head + b"64\r\n" + b"x" * 100 + b"\r\n0\r\n\r\n", "POST"
        )
        conn.close()
    assert reply is not None
    status, headers, body = reply
    assert (status, router_code(headers, body)) == (413, "payload_too_large"), body


def test_a_case_becomes_the_bytes_the_docstring_describes() -> None:
    case = Case(
        "f",
        "n",
        "POST",
        "/a\tb",
        "HTTP/1.1",
        (("Transfer-Encoding", " gzip, chunked"), ("X-\x01", "\xa0Ω")),
        "Severe",
    )
    assert request_bytes(case) == (
        b"POST /a\tb HTTP/1.1\r\nTransfer-Encoding:  gzip, chunked\r\nX-\x01: \xa0\xce\xa9\r\n"
        b"Host: desync.test\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    sized = Case("f", "n", "PUT", "/", "", (("Content-Length", " 3 "),), "Compliant")
    assert request_bytes(sized) == b"PUT /\r\nContent-Length:  3 \r\nHost: desync.test\r\n\r\nxxx"
    huge = Case("f", "n", "PUT", "/", "HTTP/1.1", (("Content-Length", "1" * 20),), "Severe")
    assert request_bytes(huge).endswith(b"\r\n\r\n")


def test_a_missing_corpus_fails_with_where_it_was_looked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "CORPUS_DIR", tmp_path / "absent")
    with pytest.raises(pytest.fail.Exception, match=r"corpus is missing: expected it at .*absent"):
        load_corpus()
