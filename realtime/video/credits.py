"""Output flow control of a video session: the client grants credits, each binary message spends one.

Producers reserve credits *before* they start work whose output needs them (so the server never
computes what the client cannot take), and refund them when that work is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class CreditGate:
    def __init__(self, initial: int, on_change: Callable[[], None] | None = None):
        self.available = initial  # granted, not reserved
        self.spent = 0  # reserved and sent (the `credits.spent` of stats)
        self._changed = asyncio.Event()
        self._on_change = on_change  # wakes whoever waits for credits with something else too

    def grant(self, n: int) -> None:
        self.available += n
        self._notify()

    def try_reserve(self, n: int = 1) -> bool:
        if self.available < n:
            return False
        self.available -= n
        return True

    async def reserve(self, n: int = 1) -> None:
        """Wait until `n` credits are free and take them."""
        while not self.try_reserve(n):
            self._changed.clear()
            await self._changed.wait()

    def refund(self, n: int = 1) -> None:
        """Reserved credits whose output was dropped go back."""
        self.available += n
        self._notify()

    def sent(self, n: int = 1) -> None:
        self.spent += n

    def _notify(self) -> None:
        self._changed.set()
        if self._on_change is not None:
            self._on_change()
