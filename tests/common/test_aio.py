"""``within``: a timeout that never loses the caller's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from cua_rl.aio import within


async def test_a_cancel_that_races_with_the_answer_is_not_lost():
    # The awaited call answers in the same loop turn as the caller is cancelled: Python 3.11's
    # wait_for returns the answer here and the cancellation disappears.
    answer = asyncio.get_running_loop().create_future()
    caller = asyncio.create_task(within(10, answer))
    await asyncio.sleep(0)
    answer.set_result("created")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller


async def test_timeout_and_result():
    assert await within(1, asyncio.sleep(0, result=7)) == 7
    with pytest.raises(TimeoutError):
        await within(0.01, asyncio.sleep(5))
