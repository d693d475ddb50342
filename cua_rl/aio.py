"""Asyncio helpers shared by the service clients.

``within(timeout, awaitable)`` replaces ``asyncio.wait_for``. On Python 3.11, when the awaited call
finishes at the moment the caller is cancelled, ``wait_for`` returns the result and the
cancellation is lost: an episode cancelled while its gym create was answering went on as if
nothing happened. ``asyncio.timeout`` re-raises an outside cancel and turns only its own expiry
into ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(timeout: float | None, awaitable: Awaitable[T]) -> T:
    """``await within(5.0, call())``: the call's result, ``TimeoutError`` after ``timeout`` s."""
    async with asyncio.timeout(timeout):
        return await awaitable
