"""The grammar of the addresses the router and its workers exchange (design §3, §5).

This module owns what a worker's url is (`http://host:port` or `unix:/absolute/path`,
as a hello, the config's `workers:` and the journal name it), what a control socket
address is (`unix:PATH` or `tcp://host:port`, as the config's `control.socket` and a
worker's `EPISODE_ROUTER_CONTROL` name it), and when two worker urls name one socket.
The router's config check, its control session, its journal, its relay and the worker
client all read addresses through these functions, so no two of them disagree on one.

It is pure: it reads the text alone, never resolves a name, opens a socket or binds a
port. A malformed address is a value (the reason, as text), never an exception.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

__all__ = [
    "HTTP",
    "TCP",
    "UNIX",
    "ControlAddress",
    "UpstreamAddress",
    "hosts_clash",
    "is_host",
    "is_ip",
    "is_loopback_host",
    "is_loopback_upstream",
    "parse_upstream",
    "read_control_address",
    "same_upstream",
    "split_host_port",
    "unix_path_problem",
]

UNIX: Final = "unix:"
TCP: Final = "tcp://"
HTTP: Final = "http://"
# A DNS-style name: dot-separated labels of letters, digits, `_` and `-`, a label never
# empty and never starting or ending with `-`. A name the resolver would refuse
# (`a..b`) is a bad address when it is read, not a connect that fails for ever.
_LABEL: Final = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"(?:{_OCTET}\.){{3}}{_OCTET}")
_HOSTNAME: Final = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")
_MAX_SUN_PATH: Final = 107  # sockaddr_un.sun_path is 108 bytes with the trailing NUL
_WILDCARDS: Final = frozenset({"0.0.0.0", "::"})


def _shown(text: str) -> str:
    """An address from a peer or a file, quoted for a message and cut short when long."""
    return repr(text[:60] + "..." if len(text) > 60 else text)


def is_ip(host: str) -> bool:
    """True for an IPv4 or IPv6 address (without brackets)."""
    # A dotted quad is matched by a regular expression first, in C, where ipaddress
    # parses in Python (about 3 us; the peer listener checks every hop's
    # X-Forwarded-For): the same addresses it takes (ASCII digits, no leading zero).
    if _IPV4.fullmatch(host) is not None:
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_host(host: str) -> bool:
    """True for an IP address or a DNS-style host name."""
    return is_ip(host) or _HOSTNAME.fullmatch(host) is not None


def is_loopback_host(host: str) -> bool:
    """True for `localhost` (any case: host names are case-insensitive) and loopback IPs.

    The one predicate for "on loopback": the config check, the control policy and the
    admin listener's token rule must never disagree about a host.
    """
    return host.lower() == "localhost" or (is_ip(host) and ipaddress.ip_address(host).is_loopback)


def split_host_port(text: str) -> tuple[str, int] | None:
    """ "host:port" or "[v6]:port" split, the port 1-65535; None when malformed."""
    host, sep, port = text.rpartition(":")
    # ASCII digits only: str.isdigit() also takes other scripts' digits, which int()
    # reads as a port nobody wrote.
    if not sep or not (port.isascii() and port.isdigit()) or len(port) > 5:
        return None
    if not 1 <= int(port) <= 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        return (host, int(port)) if ":" in host and is_ip(host) else None
    return (host, int(port)) if ":" not in host and is_host(host) else None


def unix_path_problem(path: str) -> str | None:
    """Why `path` cannot name a Unix socket, or None."""
    if not path or "\0" in path:
        return "a unix: socket needs a path"
    try:
        size = len(path.encode("utf-8"))  # as the event loop encodes it to connect or bind
    except UnicodeEncodeError:
        return "a unix socket path must be valid UTF-8"
    if size > _MAX_SUN_PATH:
        return f"unix socket path longer than {_MAX_SUN_PATH} bytes"
    return None


class UpstreamAddress(NamedTuple):
    """Where a worker url points, spelled one way: a unix socket's normalised path, or a
    host (a name lower-cased, an IP in its compressed form) and a port."""

    path: str  # "" for http
    host: str  # "" for unix
    port: int  # 0 for unix


def parse_upstream(url: str) -> UpstreamAddress | str:
    """The address `url` names ("http://host:port" or "unix:/absolute/path"), or why it
    names none. The config's upstreams, a worker's hello, a journal's worker records and
    the relay read worker urls through this one function, so none takes a url another
    refuses."""
    expected = f"expected http://host:port or unix:/absolute/path, got {_shown(url)}"
    if url.startswith(UNIX):
        path = url[len(UNIX) :]
        if not path.startswith("/"):
            return expected  # relative to whose working directory?
        problem = unix_path_problem(path)
        return problem if problem is not None else UpstreamAddress(posixpath.normpath(path), "", 0)
    address = split_host_port(url[len(HTTP) :]) if url.startswith(HTTP) else None
    if address is None:
        return expected
    host, port = address
    host = str(ipaddress.ip_address(host)) if is_ip(host) else host.lower()
    return UpstreamAddress("", host, port)


def same_upstream(a: UpstreamAddress, b: UpstreamAddress) -> bool:
    """True when `a` and `b` may be one socket: the same address, or `localhost` and a
    loopback address it commonly names, on one port. Names are never resolved."""
    if a == b:
        return True
    if a.path or b.path or a.port != b.port:
        return False
    return hosts_clash(a.host, b.host, wildcard_clashes_any=False) or hosts_clash(
        b.host, a.host, wildcard_clashes_any=False
    )


def hosts_clash(bound_host: str, host: str, *, wildcard_clashes_any: bool) -> bool:
    """True when a socket bound on `bound_host` may be the one `host` reaches: the same
    host, `localhost` and a loopback address it commonly names, or a wildcard bind
    (`0.0.0.0`, `::`) that takes loopback (and, with `wildcard_clashes_any`, any host)."""
    a, b = bound_host.lower(), host.lower()
    if a in _WILDCARDS and (wildcard_clashes_any or is_loopback_host(b) or b in _WILDCARDS):
        return True
    if b in _WILDCARDS and wildcard_clashes_any:
        return True
    aliases = {"localhost", "127.0.0.1", "::1"}
    return a == b or (a == "localhost" and b in aliases) or (b == "localhost" and a in aliases)


def is_loopback_upstream(address: UpstreamAddress) -> bool:
    """True for a unix socket or a loopback host: a worker may say hello with it without
    `control.allowed_upstreams` listing it."""
    return bool(address.path) or is_loopback_host(address.host)


@dataclass(frozen=True, slots=True)
class ControlAddress:
    """Where the router's control socket listens: a Unix path or a TCP host and port."""

    scheme: Literal["unix", "tcp"]
    path: str = ""
    host: str = ""
    port: int = 0


def read_control_address(spec: str) -> ControlAddress | str:
    """The control socket `spec` names (`unix:PATH` or `tcp://host:port`), or why it
    names none. Whether a tcp:// one may be off loopback is the caller's rule."""
    if spec.startswith(UNIX):
        path = spec[len(UNIX) :]
        problem = unix_path_problem(path)
        return problem if problem is not None else ControlAddress("unix", path=path)
    address = split_host_port(spec[len(TCP) :]) if spec.startswith(TCP) else None
    if address is None:
        return f"expected unix:PATH or tcp://HOST:PORT, got {_shown(spec)}"
    return ControlAddress("tcp", host=address[0], port=address[1])
