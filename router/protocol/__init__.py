"""The wire contracts the router and its workers share (design §3): the control
protocol's lines, versions and limits, the grammar of worker and control addresses, the
boot header and the key prefix a hello may offer. Pure: no sockets, no event loop;
imported by both sides.
"""

from __future__ import annotations

from router.protocol.addresses import (
    HTTP,
    TCP,
    UNIX,
    ControlAddress,
    UpstreamAddress,
    hosts_clash,
    is_host,
    is_ip,
    is_loopback_host,
    is_loopback_upstream,
    parse_upstream,
    read_control_address,
    same_upstream,
    split_host_port,
)
from router.protocol.boot import (
    BOOT_HEADER,
    valid_boot,
)
from router.protocol.control import (
    MAX_KEY_CHARS,
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    Reply,
    decode_line,
    decode_reply,
    encode_line,
    encoded_size,
    error_reply,
)
from router.protocol.key_prefix import (
    MAX_KEY_PREFIX_CHARS,
    key_prefix,
    split_key_prefix,
    valid_key_prefix,
)

__all__ = [
    "BOOT_HEADER",
    "HTTP",
    "MAX_KEY_CHARS",
    "MAX_KEY_PREFIX_CHARS",
    "MAX_LINE_BYTES",
    "PROTOCOL_VERSION",
    "TCP",
    "UNIX",
    "ControlAddress",
    "Reply",
    "UpstreamAddress",
    "decode_line",
    "decode_reply",
    "encode_line",
    "encoded_size",
    "error_reply",
    "hosts_clash",
    "is_host",
    "is_ip",
    "is_loopback_host",
    "is_loopback_upstream",
    "key_prefix",
    "parse_upstream",
    "read_control_address",
    "same_upstream",
    "split_host_port",
    "split_key_prefix",
    "valid_boot",
    "valid_key_prefix",
]
