"""Pure tests for the key prefix a hello reply may offer (design §10): its grammar, as
the router composes it, reads it back from a key, and the worker client checks it."""

from __future__ import annotations

import pytest

from router.protocol import key_prefix, split_key_prefix, valid_key_prefix
from router.tokens.jws import episode_key


def test_a_prefix_names_its_router_and_epoch_and_reads_back_from_a_key() -> None:
    prefix = key_prefix("gym-router-0", 7)
    assert prefix == "gym-router-0:7:"
    assert valid_key_prefix(prefix)
    assert split_key_prefix(prefix + "c0ffee") == ("gym-router-0", 7)
    # As a token's episode key carries it: "{ep}-a{att}", the prefix first.
    assert split_key_prefix(episode_key(prefix + "c0ffee", 2)) == ("gym-router-0", 7)


@pytest.mark.parametrize(
    "key",
    [
        "",
        "plain-key",
        ":7:abc",  # no router id
        "r1:7",  # no second separator
        "r1::abc",  # no epoch
        "r1:x7:abc",  # the epoch is not a number
        "r1:+7:abc",
        "r1:\u0667:abc",  # a digit, but not an ASCII one
        "r 1:7:abc",  # a router id holds no space
        "r/1:7:abc",
        "a" * 129 + ":7:abc",  # a router id is at most 128 characters
        "r1:" + "9" * 19 + ":abc",  # an epoch of more than 18 digits
        "user:42",
    ],
)
def test_a_key_that_does_not_start_with_a_prefix_names_no_router(key: str) -> None:
    assert split_key_prefix(key) is None


def test_the_longest_router_id_and_epoch_still_read_back() -> None:
    router_id = "a" * 128
    key = key_prefix(router_id, 10**17) + "x"
    assert split_key_prefix(key) == (router_id, 10**17)


@pytest.mark.parametrize(
    "value", [None, 7, "", "r1:7", "r1:7:x", "r1:7:", "r1:07:", " r1:7:", "r1:7: "]
)
def test_a_valid_prefix_is_a_router_id_an_epoch_and_two_colons(value: object) -> None:
    expected = value in ("r1:7:", "r1:07:")  # a leading zero is still a number
    assert valid_key_prefix(value) is expected
