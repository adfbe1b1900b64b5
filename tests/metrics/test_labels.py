"""Pure tests for router.metrics.labels: the fixed sets the metrics' label values come from."""

from __future__ import annotations

from router.metrics.labels import status_class


def test_status_class_covers_100_to_599_and_nothing_else() -> None:
    assert [status_class(s) for s in (100, 199, 200, 301, 404, 499, 500, 599)] == [
        *("1xx", "1xx", "2xx", "3xx", "4xx", "4xx", "5xx", "5xx")
    ]
    assert [status_class(s) for s in (0, 99, 600, -200, 1000)] == ["other"] * 5
