"""Address checks: hosts, upstream URLs, control socket specs and listener clashes.

This module owns what the configuration accepts as a host, an upstream
(`http://host:port` or `unix:/absolute/path`) and a control socket (`unix:PATH`
or a loopback `tcp://HOST:PORT`), and the check that no two listeners or
spawned ports share an address and no static worker sits on one of them.

It must never resolve a name, open a socket or bind a port: every check reads
the text alone.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from typing import TYPE_CHECKING, Final, NamedTuple

from router.config.errors import _quote

if TYPE_CHECKING:  # only annotations: both modules import this one
    from router.config.model import Config
    from router.config.reader import _Context

_UNIX: Final = "unix:"
_TCP: Final = "tcp://"
_HTTP: Final = "http://"
_HOSTNAME: Final = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?")
_MAX_SUN_PATH: Final = 107  # sockaddr_un.sun_path is 108 bytes with the trailing NUL
_WILDCARDS: Final = frozenset({"0.0.0.0", "::"})


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_host(host: str) -> bool:
    return _is_ip(host) or _HOSTNAME.fullmatch(host) is not None


def is_loopback_host(host: str) -> bool:
    """True for `localhost` (any case: host names are case-insensitive) and loopback IPs.

    The one predicate for "on loopback": the config check and the admin listener's
    token rule must never disagree about a host.
    """
    return host.lower() == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)


def is_tcp_socket(spec: str) -> bool:
    """True for a `tcp://` control socket spec (else it is a `unix:` one, once checked).

    The one test of a socket's kind: a reload that moves the socket to the other
    kind and the config check must never disagree about a spec.
    """
    return spec.startswith(_TCP)


def _split_host_port(text: str) -> tuple[str, int] | None:
    """ "host:port" or "[v6]:port" split, or None when malformed; the port is not range-checked."""
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or len(port) > 5:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        return (host, int(port)) if ":" in host and _is_ip(host) else None
    return (host, int(port)) if ":" not in host and _is_host(host) else None


def _unix_path_problem(path: str) -> str | None:
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
    """Where an upstream url points, spelled one way: a unix socket's normalised
    path, or a host (a name lower-cased, an IP in its compressed form) and a port."""

    path: str  # "" for http
    host: str  # "" for unix
    port: int  # 0 for unix


def parse_upstream(url: str) -> UpstreamAddress | str:
    """The address `url` names ("http://host:port" or "unix:/absolute/path"), or why
    it names none. The config's upstreams, a worker's hello and a journal's worker
    records are read by this one function, so none takes a url another refuses."""
    expected = f"expected http://host:port or unix:/absolute/path, got {_quote(url)}"
    if url.startswith(_UNIX):
        path = url[len(_UNIX) :]
        if not path.startswith("/"):
            return expected  # relative to whose working directory?
        problem = _unix_path_problem(path)
        return problem if problem is not None else UpstreamAddress(posixpath.normpath(path), "", 0)
    address = _split_host_port(url[len(_HTTP) :]) if url.startswith(_HTTP) else None
    if address is None or not 1 <= address[1] <= 65535:
        return expected
    host, port = address
    host = str(ipaddress.ip_address(host)) if _is_ip(host) else host.lower()
    return UpstreamAddress("", host, port)


def same_upstream(a: UpstreamAddress, b: UpstreamAddress) -> bool:
    """True when `a` and `b` may be one socket: the same address, or `localhost` and a
    loopback address it commonly names, on one port. Names are never resolved."""
    if a == b:
        return True
    if a.path or b.path or a.port != b.port:
        return False
    return _hosts_clash(a.host, b.host, wildcard_clashes_any=False) or _hosts_clash(
        b.host, a.host, wildcard_clashes_any=False
    )


def is_loopback_upstream(address: UpstreamAddress) -> bool:
    """True for a unix socket or a loopback host: a worker may say hello with it
    without `control.allowed_upstreams` listing it."""
    return bool(address.path) or is_loopback_host(address.host)


def _upstream_problem(url: str) -> str | None:
    """Why `url` is not "http://host:port" or "unix:/absolute/path", or None."""
    parsed = parse_upstream(url)
    return parsed if isinstance(parsed, str) else None


def _control_socket_problem(spec: str) -> str | None:
    if spec.startswith(_UNIX):
        return _unix_path_problem(spec[len(_UNIX) :])
    address = _split_host_port(spec[len(_TCP) :]) if spec.startswith(_TCP) else None
    if address is None or not 1 <= address[1] <= 65535:
        return f"expected unix:PATH or tcp://HOST:PORT, got {_quote(spec)}"
    if not is_loopback_host(address[0]):
        return (
            f"a tcp:// control socket must be on loopback (127.0.0.0/8, ::1, localhost), "
            f"got {_quote(address[0])}: the control protocol is not encrypted"
        )
    return None


class _Bound(NamedTuple):
    """A port range the router binds or starts a process on."""

    key_path: str
    host: str
    first: int
    last: int


def _hosts_clash(bound_host: str, host: str, *, wildcard_clashes_any: bool) -> bool:
    a, b = bound_host.lower(), host.lower()
    if a in _WILDCARDS and (wildcard_clashes_any or is_loopback_host(b) or b in _WILDCARDS):
        return True
    if b in _WILDCARDS and wildcard_clashes_any:
        return True
    aliases = {"localhost", "127.0.0.1", "::1"}
    return a == b or (a == "localhost" and b in aliases) or (b == "localhost" and a in aliases)


def _bound_ranges(config: Config) -> list[_Bound]:
    bound = [
        _Bound("listen.port", config.listen.host, config.listen.port, config.listen.port),
        _Bound("admin.port", config.admin.host, config.admin.port, config.admin.port),
    ]
    tcp = config.control.tcp_address
    if tcp is not None:
        bound.append(_Bound("control.socket", tcp[0], tcp[1], tcp[1]))
    if config.spawn is not None:
        spawn = config.spawn
        last = spawn.base_port + spawn.count - 1
        bound.append(_Bound("spawn.base_port", spawn.host, spawn.base_port, last))
    return [b for b in bound if b.first != 0]  # port 0: the kernel picks a free port


def _check_addresses(ctx: _Context, config: Config) -> None:
    """No two listeners (or spawned ports) on one address, and no worker at one of them."""
    bound = _bound_ranges(config)
    for i, later in enumerate(bound):
        for earlier in bound[:i]:
            ports = earlier.first <= later.last and later.first <= earlier.last
            if ports and _hosts_clash(earlier.host, later.host, wildcard_clashes_any=True):
                raise ctx.fail(later.key_path, f"address clashes with {earlier.key_path}")
    for i, worker in enumerate(config.workers):
        if not worker.url.startswith(_HTTP):
            continue
        host, port = _split_host_port(worker.url[len(_HTTP) :]) or ("", 0)
        for b in bound:
            clash = _hosts_clash(b.host, host, wildcard_clashes_any=False)
            if clash and b.first <= port <= b.last:
                raise ctx.fail(f"workers[{i}].url", f"is the router's own {b.key_path} address")
