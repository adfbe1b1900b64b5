"""Pure tests for the prefix routes (design §10, keys that name their router): what a
membership read lets a router route with no lookup, and for how long. No event loop."""

from __future__ import annotations

from router.directory import Member
from router.fleet.prefixes import PrefixRoutes

NOW_MS = 1_000_000  # the directory's time in the read
SENT_AT = 50.0  # this router's clock when the read was sent


def members(*records: tuple[str, int, int, str]) -> list[Member]:
    return [Member(*record) for record in records]


def routes_of_r2() -> PrefixRoutes:
    routes = PrefixRoutes("r2")
    routes.update(
        members(
            ("r1", 7, NOW_MS + 8_000, "10.0.0.1:9903"),  # 8 s of lease left
            ("r2", 3, NOW_MS + 9_000, "10.0.0.2:9903"),  # this router
            ("r3", 4, NOW_MS - 1, "10.0.0.3:9903"),  # its lease ran out
            ("r4", 2, NOW_MS + 9_000, ""),  # no peer listener advertised
        ),
        NOW_MS,
        SENT_AT,
    )
    return routes


def test_a_key_naming_a_live_peers_incarnation_goes_there() -> None:
    routes = routes_of_r2()
    owner = routes.owner("r1:7:abc-a0", SENT_AT + 1.0)
    assert owner is not None and (owner.router_id, owner.epoch, owner.peer) == (
        "r1",
        7,
        "10.0.0.1:9903",
    )


def test_only_within_the_lease_the_read_showed_counted_from_before_it_was_sent() -> None:
    routes = routes_of_r2()
    assert routes.owner("r1:7:abc", SENT_AT + 7.999) is not None
    assert routes.owner("r1:7:abc", SENT_AT + 8.0) is None  # looked up from then on


def test_anything_else_is_looked_up() -> None:
    routes = routes_of_r2()
    now = SENT_AT + 1.0
    for key in (
        "r1:6:abc",  # an earlier incarnation of r1: the directory knows where it went
        "r2:3:abc",  # this router's own: its table, then the directory
        "r3:4:abc",  # a lapsed lease
        "r4:2:abc",  # no peer listener
        "r9:1:abc",  # not a member
        "abc",  # no prefix
    ):
        assert routes.owner(key, now) is None, key


def test_a_failed_hop_drops_its_incarnation_until_the_next_read() -> None:
    routes = routes_of_r2()
    routes.drop("r1:7:abc")
    assert routes.owner("r1:7:other", SENT_AT + 1.0) is None
    routes.drop("no-prefix")  # nothing to drop
    routes.update(members(("r1", 7, NOW_MS + 8_000, "10.0.0.1:9903")), NOW_MS, SENT_AT + 2.0)
    assert routes.owner("r1:7:other", SENT_AT + 3.0) is not None


def test_a_key_naming_another_member_whatever_its_epoch_is_not_this_routers_to_hold() -> None:
    routes = routes_of_r2()
    assert routes.other_router("r1:7:abc") == "r1"
    assert routes.other_router("r1:6:abc") == "r1"  # an old epoch: still r1's key
    assert routes.other_router("r3:4:abc") == "r3"  # a member whose lease lapsed
    assert routes.other_router("r2:3:abc") is None  # its own
    assert routes.other_router("r9:1:abc") is None  # not a member: a key like any other
    assert routes.other_router("user:42:abc") is None


def test_before_any_read_nothing_is_routed_by_prefix() -> None:
    routes = PrefixRoutes("r2")
    assert routes.owner("r1:7:abc", 0.0) is None
    assert routes.other_router("r1:7:abc") is None
