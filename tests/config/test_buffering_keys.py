"""The `limits.` keys that keep worker pools from one client: parsed, defaulted, refused."""

from __future__ import annotations

import pytest

from router.config import ConfigError, LimitsConfig, parse_config
from router.relay import BufferLimits

BASE = "workers: [{id: w0, url: 'http://127.0.0.1:9001'}]\n"


def test_the_buffering_keys_default_to_a_mebibyte_each_a_256_mib_budget_and_half_a_pool() -> None:
    limits = parse_config(BASE).limits
    assert (
        limits.body_buffer_bytes,
        limits.reply_buffer_bytes,
        limits.buffer_budget_bytes,
        limits.paced_share_percent,
    ) == (1 << 20, 1 << 20, 256 << 20, 50)
    assert limits.worker_connections == 256
    assert limits == LimitsConfig()


def test_the_buffering_keys_are_read_and_zero_turns_buffering_off() -> None:
    text = BASE + (
        "limits: {body_buffer_bytes: 0, reply_buffer_bytes: 4096, buffer_budget_bytes: 0,"
        " paced_share_percent: 100}\n"
    )
    limits = parse_config(text).limits
    assert (
        limits.body_buffer_bytes,
        limits.reply_buffer_bytes,
        limits.buffer_budget_bytes,
        limits.paced_share_percent,
    ) == (0, 4096, 0, 100)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("limits: {paced_share_percent: 0}", "limits.paced_share_percent"),
        ("limits: {paced_share_percent: 101}", "limits.paced_share_percent"),
        ("limits: {body_buffer_bytes: -1}", "limits.body_buffer_bytes"),
        ("limits: {reply_buffer_bytes: 1.5}", "limits.reply_buffer_bytes"),
        ("limits: {buffer_budget_bytes: big}", "limits.buffer_budget_bytes"),
        ("limits: {worker_connections: 0}", "limits.worker_connections"),
    ],
)
def test_a_bad_buffering_key_is_an_error_naming_it(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + text + "\n")
    assert info.value.key_path == key


def test_buffer_limits_refuse_a_share_outside_its_range_and_negative_sizes() -> None:
    with pytest.raises(ValueError, match="paced_share"):
        BufferLimits(paced_share=0.0)
    with pytest.raises(ValueError, match="budget_bytes"):
        BufferLimits(budget_bytes=-1)
    assert BufferLimits().paced_share == 0.5
