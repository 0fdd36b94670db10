"""The order a pool serves its queue in: priority classes with aging, and within a class, tenants in turn.

A request carries its priority class (`priority`, 0 first) and its tenant (`tenant`), both set when its first item
is queued (stages/pool.py). Within one class the tenants take turns: each tenant's oldest item comes before anyone's
second oldest (counting the items each already has in the stage), so a tenant with a hundred items queued delays
another tenant's single item by at most one batch, not by its whole backlog. Across classes, the class whose
oldest queued item has the best aged rank (class less one per `aging_s` waited) goes first: a lower class waits
behind fresh higher ones for a bounded time, never forever. With one tenant this is plain priority with aging,
arrival order among equals.

A loop stage's step picks its rows with `take_in_turns`: the same turns among the items in the loop.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Iterator, Mapping, Sequence

NORMAL_PRIORITY = 1  # the rank of requests submitted without one (serve/tenants.py: high 0, normal 1, low 2)


def priority_of(item) -> int:
    return getattr(item.request, "priority", NORMAL_PRIORITY)


def tenant_of(item) -> str:
    return getattr(item.request, "tenant", "")


def _in_turns(items: Iterable[Any], serving: Mapping[str, int] | None = None) -> list[Any]:
    """Items (in their order) regrouped in rounds: each tenant's first, then each tenant's second, ... A tenant
    already holding `serving[tenant]` items in the stage starts that many rounds later."""
    turn: collections.Counter[str] = collections.Counter(serving or {})
    keyed = []
    for position, item in enumerate(items):
        tenant = tenant_of(item)
        keyed.append((turn[tenant], position, item))
        turn[tenant] += 1
    return [item for _, _, item in sorted(keyed, key=lambda k: k[:2])]


def service_order(queue: Iterable[Any], now: float, aging_s: float,
                  serving: Mapping[str, int] | None = None) -> Iterator[Any]:
    """The queued items (each with `request` and `enqueued_at`) in the order they are taken; `serving`: the items
    each tenant has in the stage already (taken, not finished)."""
    classes: dict[int, collections.deque] = {}
    arrivals: dict[int, collections.deque] = {}  # each class's items by arrival: its oldest still queued
    for item in sorted(queue, key=lambda i: i.enqueued_at):
        arrivals.setdefault(priority_of(item), collections.deque()).append(item)
    for rank, items in arrivals.items():
        classes[rank] = collections.deque(_in_turns(items, serving))
    taken: set[int] = set()
    while classes:
        for rank, oldest in arrivals.items():
            while oldest and id(oldest[0]) in taken:
                oldest.popleft()
        rank = min(classes, key=lambda r: r - (now - arrivals[r][0].enqueued_at) / aging_s)
        item = classes[rank].popleft()
        taken.add(id(item))
        if not classes[rank]:
            del classes[rank]
            del arrivals[rank]
        yield item


def take_in_turns(items: Sequence[Any], limit: int) -> list[Any]:
    """Up to `limit` of a loop's items for one step, the tenants in turns (items keep their order within one).
    One tenant's items are their own order (every step of a loop asks: the rounds are not built for them)."""
    if len({tenant_of(item) for item in items}) <= 1:
        return list(items[:limit])
    return _in_turns(items)[:limit]
