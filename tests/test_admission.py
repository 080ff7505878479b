"""Admission: the concurrency limit, FIFO queue, its bound and cancelled waiters.

No sleeping: tasks are stepped with ``asyncio.sleep(0)`` (one pass of the loop), and
every wait is on the admission object's own futures.
"""

from __future__ import annotations

import asyncio

import pytest

from proxy.admission import Admission, QueueFull

pytestmark = pytest.mark.anyio



async def settle(rounds: int = 5) -> None:
    """Let every ready task run (not a timed wait: zero-second yields)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_unlimited_never_waits() -> None:
    adm = Admission(0, 0)
    assert not adm.limited
    for _ in range(100):
        await adm.acquire()
    assert adm.active == 0
    adm.release()  # a no-op, never negative
    assert adm.active == 0


async def test_limit_and_release() -> None:
    adm = Admission(2, 10)
    await adm.acquire()
    await adm.acquire()
    assert adm.active == 2
    third = asyncio.create_task(adm.acquire())
    await settle()
    assert not third.done()
    assert adm.waiting == 1
    adm.release()
    await settle()
    assert third.done()
    assert adm.active == 2  # the slot passed on, not freed
    assert adm.waiting == 0
    adm.release()
    adm.release()
    assert adm.active == 0


async def test_fifo_order() -> None:
    adm = Admission(1, 10)
    await adm.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await adm.acquire()
        order.append(i)

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(waiter(i)))
        await settle()  # enqueue strictly in this order
    assert adm.waiting == 5
    for expected in range(5):
        adm.release()
        await settle()
        assert order == list(range(expected + 1))
    await asyncio.gather(*tasks)
    adm.release()
    assert adm.active == 0


async def test_a_newcomer_does_not_overtake_the_queue() -> None:
    adm = Admission(1, 10)
    await adm.acquire()
    first = asyncio.create_task(adm.acquire())
    await settle()
    adm.release()  # the slot is handed to `first` ...
    newcomer = asyncio.create_task(adm.acquire())  # ... before it has even run
    await settle()
    assert first.done()
    assert not newcomer.done()
    adm.release()
    await settle()
    assert newcomer.done()


async def test_queue_full_at_the_bound() -> None:
    adm = Admission(1, 2)
    await adm.acquire()
    waiters = [asyncio.create_task(adm.acquire()) for _ in range(2)]
    await settle()
    assert adm.waiting == 2
    with pytest.raises(QueueFull):
        await adm.acquire()
    assert adm.waiting == 2  # the refused one left no trace
    for _ in range(3):
        adm.release()
        await settle()
    await asyncio.gather(*waiters)
    assert adm.active == 0


async def test_zero_queue_refuses_at_once() -> None:
    adm = Admission(1, 0)
    await adm.acquire()
    with pytest.raises(QueueFull):
        await adm.acquire()


async def test_cancelled_waiter_leaves_the_queue() -> None:
    adm = Admission(1, 2)
    await adm.acquire()
    a = asyncio.create_task(adm.acquire())
    b = asyncio.create_task(adm.acquire())
    await settle()
    a.cancel()
    await settle()
    assert a.cancelled()
    assert adm.waiting == 1
    # its place is free again: the bound counts only live waiters
    c = asyncio.create_task(adm.acquire())
    await settle()
    assert not c.done()
    adm.release()
    await settle()
    assert b.done() and not c.done()  # b was next, a never got a slot
    adm.release()
    await settle()
    assert c.done()
    adm.release()
    assert adm.active == 0


async def test_slot_handed_to_a_cancelled_waiter_passes_on() -> None:
    adm = Admission(1, 5)
    await adm.acquire()
    a = asyncio.create_task(adm.acquire())
    b = asyncio.create_task(adm.acquire())
    await settle()
    adm.release()  # hands the slot to a ...
    a.cancel()  # ... which is cancelled before it could resume
    await settle()
    assert a.cancelled()
    assert b.done() and not b.cancelled()  # so b got it
    assert adm.active == 1
    adm.release()
    assert adm.active == 0
    assert adm.waiting == 0


async def test_limit_holds_under_many_tasks() -> None:
    limit = 3
    adm = Admission(limit, 100)
    running = 0
    peak = 0
    gate = asyncio.Event()

    async def work() -> None:
        nonlocal running, peak
        await adm.acquire()
        running += 1
        peak = max(peak, running)
        await gate.wait()
        running -= 1
        adm.release()

    tasks = [asyncio.create_task(work()) for _ in range(20)]
    await settle()
    assert running == limit
    assert adm.waiting == 20 - limit
    gate.set()
    await asyncio.gather(*tasks)
    assert peak == limit
    assert adm.active == 0
