"""The directory's pure parts, without an event loop: keys, decoding, meanings, settings."""

from __future__ import annotations

import pytest

from router.directory import (
    ClaimOutcome,
    ClaimVerdict,
    DirectoryReplyError,
    DirectorySettings,
    FleetView,
    KeyLayout,
    LookupResult,
    LookupState,
    Member,
    Owner,
    OwnerState,
    ReleaseVerdict,
    RequestMeaning,
    Standing,
    meaning_of,
    redis_url,
    sentinel_nodes,
)
from router.directory.records import (
    ABSENT,
    OwnerWorker,
    decode_claims,
    decode_heartbeat,
    decode_lookup,
    decode_member,
    decode_registration,
    decode_releases,
    decode_worker,
    encode_worker,
)


def test_every_key_of_a_fleet_sits_behind_its_hash_tag() -> None:
    layout = KeyLayout("gym-a")
    assert layout.prefix == "{gym-a}"
    assert layout.owner("episode", "ep7-a0") == "{gym-a}:owner:episode:ep7-a0"
    assert layout.members() == "{gym-a}:members"
    assert layout.fleet() == "{gym-a}:fleet"
    assert layout.epoch("pod-1") == "{gym-a}:epoch:pod-1"
    assert layout.death("pod-1", 7) == "{gym-a}:dead:pod-1:7"
    assert layout.held("pod-1", 7) == "{gym-a}:held:pod-1:7"
    assert layout.workers("pod-1", 7) == "{gym-a}:workers:pod-1:7"
    assert layout.workers("pod-1", 7).startswith(layout.workers_prefix)
    assert KeyLayout().prefix == "{episode-router}"


@pytest.mark.parametrize("fleet", ["", "a{b", "a}b", "a b", "x" * 65])
def test_a_prefix_that_would_break_the_hash_tag_is_refused(fleet: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        KeyLayout(fleet)


@pytest.mark.parametrize("router_id", ["", "a:b", "a b", "x" * 129])
def test_a_router_id_that_would_split_a_key_is_refused(router_id: str) -> None:
    with pytest.raises(ValueError, match="router_id"):
        DirectorySettings(router_id)


def test_settings_derive_the_script_timings_from_the_lease() -> None:
    s = DirectorySettings("pod-1", lease_ttl_s=9, tombstone_ttl_s=60)
    assert (s.lease_ms, s.quiet_ms, s.heartbeat_interval_s, s.tombstone_ms) == (
        9000,
        4500,
        3,
        60000,
    )
    assert (s.lookup_timeout_ms, s.claim_timeout_s) == (50, 2.0)
    with pytest.raises(ValueError):
        DirectorySettings("pod-1", lease_ttl_s=0)
    with pytest.raises(ValueError):
        DirectorySettings("pod-1", peer_address="a b")


FLEET = [1000, 0, 500]  # now, since, grace: a settled fleet


def test_a_lookup_answer_decodes_into_one_result_per_key() -> None:
    reply = [*FLEET, "a", "", "", "", "", "", "h", "r2", "7", "http://10.0.0.2:9903", 8000, ""]
    reply += ["e", "r3", "4", "", "", "", "x", "r4", "2", "", "", ""]
    reply += ["h", "r5", "3", "127.0.0.1:9903", 500, "unix:/run/w0.sock b00t"]
    batch = decode_lookup(reply, 5)
    assert batch.fleet == FleetView(1000, 0, 500)
    assert batch.results == (
        ABSENT,
        LookupResult(
            LookupState.HELD, Owner("r2", 7, OwnerState.HELD), "http://10.0.0.2:9903", 8000
        ),
        LookupResult(LookupState.ENDED, Owner("r3", 4, OwnerState.ENDED)),
        LookupResult(LookupState.DEAD, Owner("r4", 2, OwnerState.HELD)),
        LookupResult(
            LookupState.HELD,
            Owner("r5", 3, OwnerState.HELD),
            "127.0.0.1:9903",
            500,
            OwnerWorker("unix:/run/w0.sock", "b00t"),
        ),
    )
    assert decode_worker(encode_worker("http://127.0.0.1:9001", "x")) == OwnerWorker(
        "http://127.0.0.1:9001", "x"
    )


@pytest.mark.parametrize(
    "reply",
    [
        None,
        "ok",
        [*FLEET],  # one key asked, none answered
        [*FLEET, "q", "r1", "1", "", "", ""],  # an unknown code
        [*FLEET, "h", "r1", "one", "", 10, ""],  # an epoch that is no number
        [*FLEET, "h", "r1", "1", "p", "", ""],  # a held answer without its lease left
        [*FLEET, "h", "r1", "1", "p", 10, "http://w0"],  # a worker without its boot
        [*FLEET, "h", "r1", "1", "p", 10, "http://w0 a b"],  # a boot with a space
        [*FLEET, *["a", "", "", "", "", ""] * 2],  # two answers for one key
        [*FLEET, "a", "", "", "", ""],  # the answer of the old, shorter shape
    ],
)
def test_a_lookup_answer_of_the_wrong_shape_is_a_reply_error(reply: object) -> None:
    with pytest.raises(DirectoryReplyError):
        decode_lookup(reply, 1)


def test_claim_and_release_answers_decode_with_their_standing() -> None:
    claims = decode_claims(["ok", "ok", "", "conflict", "r2", "ended", "", "worker_exited", ""], 4)
    assert claims == (
        Standing.OK,
        (
            ClaimOutcome(ClaimVerdict.CLAIMED),
            ClaimOutcome(ClaimVerdict.CONFLICT, "r2"),
            ClaimOutcome(ClaimVerdict.ENDED),
            ClaimOutcome(ClaimVerdict.EXITED),
        ),
    )
    assert decode_claims(["fenced"], 3) == (Standing.FENCED, ())
    assert decode_releases(["ok", "ok", "not_holder"], 2) == (
        Standing.OK,
        (ReleaseVerdict.RELEASED, ReleaseVerdict.NOT_HOLDER),
    )
    assert decode_releases(["lost"], 2) == (Standing.LOST, ())
    for bad in (["ok", "ok", ""], ["ok", "maybe", ""], ["sure"]):
        with pytest.raises(DirectoryReplyError):
            decode_claims(bad, 2)


def test_register_heartbeat_and_membership_answers_decode() -> None:
    registration = decode_registration([42, 11000, 1000, 900, 1500])
    assert (registration.epoch, registration.lease_deadline_ms) == (42, 11000)
    assert registration.fleet == FleetView(1000, 900, 1500)
    beat = decode_heartbeat(["fenced", 0, 1200])
    assert (beat.standing, beat.lease_deadline_ms, beat.now_ms) == (Standing.FENCED, 0, 1200)
    assert decode_member("r1", "42 11000 http://10.0.0.1:9903") == Member(
        "r1", 42, 11000, "http://10.0.0.1:9903"
    )
    assert decode_member("r1", "42 11000 ") == Member("r1", 42, 11000, "")
    with pytest.raises(DirectoryReplyError):
        decode_member("r1", "x 11000 peer")
    with pytest.raises(DirectoryReplyError):
        decode_heartbeat(["asleep", 0, 1])


SETTLED = FleetView(now_ms=50_000, since_ms=0, grace_until_ms=10_000)
YOUNG = FleetView(now_ms=50_000, since_ms=45_000, grace_until_ms=55_000)
LEASE_MS = 10_000


@pytest.mark.parametrize(
    ("result", "fleet", "meaning"),
    [
        (LookupResult(LookupState.HELD, Owner("me", 5, OwnerState.HELD), "p"), SETTLED, "local"),
        (
            LookupResult(LookupState.HELD, Owner("me", 4, OwnerState.HELD), "p"),
            SETTLED,
            "worker_exited",
        ),
        (LookupResult(LookupState.HELD, Owner("r2", 1, OwnerState.HELD), "p"), SETTLED, "peer"),
        (LookupResult(LookupState.DEAD, Owner("r2", 1, OwnerState.HELD)), SETTLED, "worker_exited"),
        (
            LookupResult(LookupState.ENDED, Owner("r2", 1, OwnerState.ENDED)),
            SETTLED,
            "episode_ended",
        ),
        (ABSENT, SETTLED, "unknown"),
        # The fleet record is younger than a lease: repopulating, so never a wrong 401.
        (ABSENT, YOUNG, "recovering"),
        (LookupResult(LookupState.ENDED, Owner("r2", 1, OwnerState.ENDED)), YOUNG, "episode_ended"),
    ],
)
def test_what_each_lookup_result_means_for_a_request(
    result: LookupResult, fleet: FleetView, meaning: str
) -> None:
    assert meaning_of(result, fleet, "me", 5, LEASE_MS) is RequestMeaning(meaning)


def test_directory_addresses_become_redis_urls() -> None:
    assert redis_url("redis://10.0.0.5:6379/2") == "redis://10.0.0.5:6379/2"
    assert redis_url("unix:/run/redis/redis.sock") == "unix:///run/redis/redis.sock"
    for bad in ("http://x", "unix:relative.sock", "10.0.0.5:6379"):
        with pytest.raises(ValueError):
            redis_url(bad)
    assert sentinel_nodes(["10.0.0.1:26379", "[::1]:26380"]) == (
        ("10.0.0.1", 26379),
        ("::1", 26380),
    )
    for nodes in ([], ["host"], ["host:0"], [":26379"]):
        with pytest.raises(ValueError):
            sentinel_nodes(nodes)
