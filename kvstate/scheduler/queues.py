"""The scheduler's request containers: lists kept in increasing order of each request's own number.

Invariants kept:
* a container ordered `BY_ARRIVAL` holds its requests in arrival order, one ordered `BY_ADMISSION` in admission
  order (the most recently admitted last: victims are taken from the tail);
* a request is inserted and removed by bisection on its number, so neither reads the requests around it;
* a request that is not where its number puts it means the container was changed from outside: an error, never a
  silent linear search.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable

from kvstate.errors import KVStateError
from kvstate.request import Request

__all__ = ["BY_ADMISSION", "BY_ARRIVAL", "insert_ordered", "remove_ordered"]

BY_ARRIVAL: Callable[[Request], int] = operator.attrgetter("arrival")  # the order of the state containers
BY_ADMISSION: Callable[[Request], int] = operator.attrgetter("admission")  # the order of `admitted` (VICTIM-TAIL)


def insert_ordered(items: list[Request], request: Request, key: Callable[[Request], int]) -> None:
    """Insert `request` into `items`, kept in increasing order of `key`."""
    bisect.insort(items, request, key=key)


def remove_ordered(items: list[Request], request: Request, key: Callable[[Request], int]) -> None:
    """Remove `request` from `items`, which is in increasing order of `key` (each request's own number: its arrival
    or admission), by bisection: O(log n) key reads and one move, where `list.remove` would compare every request
    before it."""
    index = bisect.bisect_left(items, key(request), key=key)
    if index == len(items) or items[index] is not request:
        raise KVStateError(
            f"request {request.request_id!r} is not where its order puts it in its container; the scheduler's "
            "containers were changed from outside the scheduler"
        )
    del items[index]
