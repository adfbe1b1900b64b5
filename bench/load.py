"""Load generation: a serial client, a bundled closed-loop and paced generator, and wrk.

This module owns how requests are sent and timed. Every request is a small POST
carrying one of the claimed episodes' tokens, cycled in order, on keep-alive
connections to 127.0.0.1. The reply parser and wrk's script and output parser
are pure; the clients are thin. It never decides what a figure means: that is
bench.report's.

- `serial_latencies`: one blocking keep-alive connection, N requests one after
  another, each timed with `perf_counter_ns` (the added-latency figure).
- `closed_loop`: C connections, each sending its next request when the previous
  reply ends (a fallback for wrk, and the quick mode's generator).
- `paced`: C connections sending at a fixed total rate (latency at half of
  saturation, when wrk is missing). Latency is timed from the actual send, and
  the rate achieved is reported beside the rate asked for.
- `run_wrk`: wrk with a Lua script that cycles through the tokens; with
  `paced_wrk_script`, each connection also waits a think time before each
  request (wrk's `delay()` hook), which paces the run at about a given rate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import re
import socket
import subprocess
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

__all__ = [
    "LoadResult",
    "ReplyParser",
    "build_request",
    "closed_loop",
    "paced",
    "paced_wrk_script",
    "parse_wrk",
    "percentile",
    "run_async",
    "run_wrk",
    "serial_latencies",
    "wrk_delay_ms",
    "wrk_script",
]

T = TypeVar("T")
REQUEST_PATH = "/tools/echo"
REQUEST_BODY = b'{"tool": "echo", "args": {"value": 1, "note": "a small tool call"}}'
DRAIN_S = 5.0  # after a run's end, how long replies still in flight are waited for
_HEAD_END = b"\r\n\r\n"


def build_request(token: str, port: int, body: bytes = REQUEST_BODY) -> bytes:
    """The bytes of one keep-alive POST carrying `token` (what wrk's script sends too)."""
    head = (
        f"POST {REQUEST_PATH} HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"X-NeMo-Gym-Episode-Token: {token}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    )
    return head.encode("ascii") + body


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile of already sorted values (0.0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), math.ceil(fraction * len(sorted_values))))
    return float(sorted_values[rank - 1])


class ReplyParser:
    """Finds the ends of HTTP/1.1 replies in a byte stream (Content-Length or chunked)."""

    __slots__ = ("_buffer", "_chunked", "_need", "statuses")

    def __init__(self) -> None:
        self._buffer = b""
        self._need = 0  # body bytes still to come for the reply being read
        self._chunked = False
        self.statuses: list[int] = []  # the status of every reply completed so far

    def feed(self, data: bytes) -> int:
        """Takes the next bytes; returns how many replies they completed.
        Raises ValueError on bytes that are not an HTTP/1.1 reply."""
        self._buffer += data
        done = 0
        while self._step():
            done += 1
        return done

    def _step(self) -> bool:
        """Consumes as much as it can; True when a reply just ended."""
        if self._need or self._chunked:
            return self._body()
        end = self._buffer.find(_HEAD_END)
        if end < 0:
            return False
        head = self._buffer[:end].lower()
        if not head.startswith(b"http/1."):
            raise ValueError(f"not an HTTP/1.x reply: {head[:40]!r}")
        self.statuses.append(int(head[9:12]))
        self._buffer = self._buffer[end + 4 :]
        self._chunked = b"\r\ntransfer-encoding: chunked" in head
        match = re.search(rb"\r\ncontent-length:\s*(\d+)", head)
        self._need = int(match.group(1)) if match and not self._chunked else 0
        return self._body()

    def _body(self) -> bool:
        if self._chunked:
            return self._chunk()
        take = min(self._need, len(self._buffer))
        self._buffer = self._buffer[take:]
        self._need -= take
        return self._need == 0

    def _chunk(self) -> bool:
        while True:
            if self._need:
                take = min(self._need, len(self._buffer))
                self._buffer = self._buffer[take:]
                self._need -= take
                if self._need:
                    return False
            line_end = self._buffer.find(b"\r\n")
            if line_end < 0:
                return False
            size = int(self._buffer[:line_end].split(b";")[0], 16)
            if size == 0:
                end = self._buffer.find(_HEAD_END, line_end)  # after any trailers
                if end < 0:
                    return False  # trailers not complete yet
                self._buffer = self._buffer[end + 4 :]
                self._chunked = False
                return True
            self._buffer = self._buffer[line_end + 2 :]
            self._need = size + 2  # the data and its CRLF


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One load run: what was sent, what came back, and how fast."""

    tool: str  # "wrk" or "bundled"
    requests: int  # replies received
    errors: int  # non-2xx replies and connection errors
    seconds: float
    p50_us: float
    p99_us: float
    rate_asked: float | None = None  # paced runs only

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


# --- the serial client --------------------------------------------------------------------------


def serial_latencies(port: int, requests: Sequence[bytes], count: int, warmup: int) -> list[int]:
    """Per-request latencies (ns) of `count` requests sent one after another on one
    keep-alive connection, after `warmup` untimed ones. Raises OSError, or ValueError
    when a reply is not 2xx."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        parser = ReplyParser()
        latencies: list[int] = []
        clock = time.perf_counter_ns
        for index in range(warmup + count):
            request = requests[index % len(requests)]
            started = clock()
            sock.sendall(request)
            while not parser.feed(_received(sock)):
                pass
            elapsed = clock() - started
            if index >= warmup:
                latencies.append(elapsed)
        bad = [status for status in parser.statuses if not 200 <= status < 300]
        if bad:
            raise ValueError(f"{len(bad)} replies were not 2xx (first: {bad[0]})")
        return latencies


def _received(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise OSError("the proxy closed the connection before the reply ended")
    return data


# --- the bundled generator ----------------------------------------------------------------------


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Runs `coro` to its end on a fresh uvloop loop (asyncio's own when uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of the router
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


class _Run:
    """The shared state of one generator run."""

    __slots__ = ("deadline", "errors", "interval", "latencies", "loop", "requests", "stopped")

    def __init__(self, requests: Sequence[bytes], deadline: float, interval: float) -> None:
        self.requests = requests
        self.loop = asyncio.get_running_loop()
        self.deadline = deadline
        self.interval = interval  # seconds between one connection's sends; 0: closed loop
        self.latencies: list[int] = []
        self.errors = 0
        self.stopped = asyncio.get_running_loop().create_future()


class _Connection(asyncio.Protocol):
    """One keep-alive connection sending one request at a time."""

    def __init__(self, run: _Run, offset: int, first_send: float) -> None:
        self.run = run
        self.index = offset
        self.parser = ReplyParser()
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0
        self.next_send = first_send
        self.idle = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they have its methods.
        self.transport = cast(asyncio.Transport, transport)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._schedule()

    def _schedule(self) -> None:
        run = self.run
        now = run.loop.time()
        if now >= run.deadline:
            self._finish()
        elif run.interval and self.next_send > now:
            run.loop.call_at(self.next_send, self._send)
        else:
            self._send()

    def _send(self) -> None:
        run = self.run
        if self.transport is None or self.transport.is_closing():
            self._finish()
            return
        request = run.requests[self.index % len(run.requests)]
        self.index += 1
        self.next_send += run.interval
        self.sent_at = time.perf_counter_ns()
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        try:
            done = self.parser.feed(data)
        except ValueError:
            self.run.errors += 1
            self._finish()
            return
        if done:
            self.run.latencies.append(time.perf_counter_ns() - self.sent_at)
            status = self.parser.statuses[-1]
            if not 200 <= status < 300:
                self.run.errors += 1
            self._schedule()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.idle.done():
            self.run.errors += 1  # closed under a request, or before the run ended
            self.idle.set_result(None)

    def _finish(self) -> None:
        if not self.idle.done():
            self.idle.set_result(None)
        if self.transport is not None:
            self.transport.close()


async def _generate(
    port: int, requests: Sequence[bytes], connections: int, seconds: float, rate: float | None
) -> LoadResult:
    loop = asyncio.get_running_loop()
    interval = connections / rate if rate else 0.0
    start = loop.time() + 0.05
    run = _Run(requests, start + seconds, interval)
    conns: list[_Connection] = []
    for i in range(connections):
        first = start + (interval * i / connections if interval else 0.0)
        offset = i * 7  # connections start at different tokens
        try:
            _, conn = await loop.create_connection(
                functools.partial(_Connection, run, offset, first),
                "127.0.0.1",
                port,
            )
        except OSError:
            run.errors += 1
            continue
        conns.append(conn)
    began = time.perf_counter()
    try:
        async with asyncio.timeout(seconds + DRAIN_S + 1):
            await asyncio.gather(*(conn.idle for conn in conns))
    except TimeoutError:
        run.errors += sum(1 for conn in conns if not conn.idle.done())
    elapsed = min(time.perf_counter() - began, seconds + DRAIN_S)
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    ordered = sorted(run.latencies)
    return LoadResult(
        tool="bundled",
        requests=len(ordered),
        errors=run.errors,
        seconds=max(elapsed, 1e-9),
        p50_us=percentile(ordered, 0.50) / 1000,
        p99_us=percentile(ordered, 0.99) / 1000,
        rate_asked=rate,
    )


async def closed_loop(
    port: int, requests: Sequence[bytes], connections: int, seconds: float
) -> LoadResult:
    """`connections` connections, each sending its next request as its reply ends."""
    return await _generate(port, requests, connections, seconds, None)


async def paced(
    port: int, requests: Sequence[bytes], connections: int, seconds: float, rate: float
) -> LoadResult:
    """`connections` connections sending `rate` requests per second in all (less if the
    target cannot keep up: `rps` tells what was achieved)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return await _generate(port, requests, connections, seconds, rate)


# --- wrk ----------------------------------------------------------------------------------------


def wrk_script(tokens: Sequence[str], body: bytes = REQUEST_BODY) -> str:
    """A wrk Lua script: each thread prebuilds one POST per token and cycles through them."""
    quoted = ",\n".join(f'  "{token}"' for token in tokens)
    return (
        f"local tokens = {{\n{quoted}\n}}\n"
        f"local body = [[{body.decode()}]]\n"
        "local requests = {}\n"
        "local counter = 0\n"
        "function init(args)\n"
        "  for i, token in ipairs(tokens) do\n"
        f'    requests[i] = wrk.format("POST", "{REQUEST_PATH}", {{\n'
        '      ["X-NeMo-Gym-Episode-Token"] = token,\n'
        '      ["Content-Type"] = "application/json"}, body)\n'
        "  end\n"
        "end\n"
        "function request()\n"
        "  counter = counter + 1\n"
        "  return requests[(counter % #requests) + 1]\n"
        "end\n"
    )


def wrk_delay_ms(connections: int, rate: float) -> float:
    """The think time (ms) each of `connections` connections waits before each request
    so that together they send about `rate` requests a second: connections / rate s.

    This is a closed loop with think time, not an open-loop schedule: a connection
    waits this long after its previous reply ends, so its period is the delay plus
    the response time, and the rate achieved is slightly below `rate`. Nothing is
    subtracted for the response time (it differs per proxy); the achieved rate is
    measured and reported beside the rate asked."""
    if connections <= 0 or rate <= 0:
        raise ValueError(f"connections and rate must be positive, got {connections}, {rate!r}")
    return connections / rate * 1000.0


def paced_wrk_script(
    tokens: Sequence[str], connections: int, delay_ms: float, body: bytes = REQUEST_BODY
) -> str:
    """`wrk_script` plus a `delay()` hook: wrk calls it before each request a connection
    sends, first one included, and waits the milliseconds it returns. `connections` is
    the number of connections per wrk thread (each thread has its own Lua state).

    - The first request of each connection is staggered over one period (the k-th
      waits floor(k * delay_ms / connections)), so the connections do not start in
      a burst and stay spread out.
    - wrk waits whole milliseconds (it truncates the number returned), so each
      thread carries the fraction over to its next request: the mean think time is
      `delay_ms` exactly."""
    if connections <= 0 or delay_ms < 0:
        raise ValueError(f"bad pacing: {connections} connections, {delay_ms!r} ms")
    return wrk_script(tokens, body) + (
        f"local delay_ms = {delay_ms:.6f}\n"
        f"local connections = {connections}\n"
        "local started = 0\n"
        "local owed = 0.0\n"
        "function delay()\n"
        "  if started < connections then\n"
        "    started = started + 1\n"
        "    return math.floor((started - 1) * delay_ms / connections)\n"
        "  end\n"
        "  owed = owed + delay_ms\n"
        "  local whole = math.floor(owed)\n"
        "  owed = owed - whole\n"
        "  return whole\n"
        "end\n"
    )


_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}


def _microseconds(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text)
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_wrk(text: str) -> LoadResult:
    """Reads wrk's report (run with --latency). Raises ValueError when a figure is missing."""
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m|h)", text)
    p50 = re.search(r"^\s+50%\s+(\S+)", text, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", text, re.M)
    if done is None or p50 is None or p99 is None:
        raise ValueError(f"wrk's report lacks its figures:\n{text}")
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    socket_errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text
    )
    errors = int(non_2xx.group(1)) if non_2xx else 0
    if socket_errors:
        errors += sum(int(value) for value in socket_errors.groups())
    return LoadResult(
        tool="wrk",
        requests=int(done.group(1)),
        errors=errors,
        seconds=_microseconds(done.group(2) + done.group(3)) / 1e6,
        p50_us=_microseconds(p50.group(1)),
        p99_us=_microseconds(p99.group(1)),
    )


def run_wrk(
    binary: str,
    port: int,
    script: str,
    connections: int,
    threads: int,
    seconds: float,
    rate_asked: float | None = None,
) -> LoadResult:
    """Runs wrk against 127.0.0.1:`port` with the Lua script file `script`
    (`rate_asked`: the rate a paced script aims at, recorded in the result)."""
    argv = [
        binary,
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--latency",
        "-s",
        script,
        f"http://127.0.0.1:{port}{REQUEST_PATH}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip()}")
    return dataclasses.replace(parse_wrk(done.stdout), rate_asked=rate_asked)
