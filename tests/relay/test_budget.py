"""The process's buffer budget: reservations that fit, refusals that do not, returns."""

from __future__ import annotations

from router.relay.budget import BufferBudget


def test_a_reservation_that_fits_is_held_and_one_that_does_not_is_refused_whole() -> None:
    budget = BufferBudget(100)
    assert budget.reserve(60) is True
    assert (budget.held, budget.refused) == (60, 0)
    assert budget.reserve(41) is False  # never cut down to what is left
    assert (budget.held, budget.refused) == (60, 1)
    assert budget.reserve(40) is True
    assert budget.held == 100


def test_bytes_given_back_make_room_again() -> None:
    budget = BufferBudget(10)
    assert budget.reserve(10)
    assert not budget.reserve(1)
    budget.give_back(10)
    assert (budget.held, budget.reserve(10)) == (0, True)


def test_a_zero_budget_holds_only_empty_reservations() -> None:
    budget = BufferBudget(0)
    assert (budget.reserve(0), budget.reserve(1)) == (True, False)
