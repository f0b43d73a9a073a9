"""One timer keeps a stream's read timeout (:class:`proxy.api.silence.Silence`):
it cancels only a read pending past its own limit, however long the stream."""

from __future__ import annotations

import time

import anyio
import pytest

from proxy.api.silence import Silence, fast_checkpoint

pytestmark = pytest.mark.anyio

LIMIT_S = 0.15


async def test_reads_each_within_the_limit_never_expire() -> None:
    """Many quick reads, longer in all than the limit: no timeout."""
    with Silence(LIMIT_S) as silence:
        end = time.monotonic() + 3 * LIMIT_S
        while time.monotonic() < end:
            silence.reading(LIMIT_S)
            await anyio.sleep(LIMIT_S / 5)
            silence.read()
    assert not silence.expired


async def test_a_read_pending_past_its_limit_is_cancelled() -> None:
    started = time.monotonic()
    with Silence(LIMIT_S) as silence:
        silence.reading(LIMIT_S)
        await anyio.sleep(LIMIT_S / 3)
        silence.read()
        silence.reading(LIMIT_S)  # the second read never returns
        await anyio.sleep(30)
    waited = time.monotonic() - started
    assert silence.expired
    assert LIMIT_S * 4 / 3 <= waited < LIMIT_S * 4 / 3 + 1.0


async def test_time_spent_between_reads_is_not_counted() -> None:
    """Only a pending read is timed: delivering an event (a slow client) is not."""
    with Silence(LIMIT_S) as silence:
        silence.reading(LIMIT_S)
        silence.read()
        await anyio.sleep(3 * LIMIT_S)  # no read pending
        silence.reading(LIMIT_S)
        await anyio.sleep(LIMIT_S / 2)
        silence.read()
    assert not silence.expired


async def test_the_first_read_may_have_a_longer_limit_than_the_rest() -> None:
    with Silence(LIMIT_S) as silence:
        silence.reading(3 * LIMIT_S)  # the first byte may take longer
        await anyio.sleep(2 * LIMIT_S)
        silence.read()
        silence.reading(LIMIT_S)
        await anyio.sleep(30)
    assert silence.expired and silence.limit == LIMIT_S


async def test_a_short_limit_after_a_long_first_one_is_kept_on_time() -> None:
    """The watchdog, asleep towards a long first limit, still times a later read
    by its own (shorter) limit."""
    long_s = 20 * LIMIT_S
    with Silence(LIMIT_S) as silence:
        silence.reading(long_s)
        await anyio.sleep(0.01)
        silence.read()
        silence.reading(LIMIT_S)  # never returns
        started = time.monotonic()
        await anyio.sleep(30)
    waited = time.monotonic() - started
    assert silence.expired
    assert LIMIT_S <= waited < 2 * LIMIT_S + 0.5 < long_s


async def test_the_fast_checkpoint_lets_other_tasks_run() -> None:
    checkpoint = fast_checkpoint()
    ran = False

    async def other() -> None:
        nonlocal ran
        ran = True

    async with anyio.create_task_group() as group:
        group.start_soon(other)
        await checkpoint()
        assert ran


async def test_leaving_the_block_stops_the_timer_and_errors_pass_through() -> None:
    with Silence(LIMIT_S) as silence:
        silence.reading(LIMIT_S)  # left with the read pending
    await anyio.sleep(2 * LIMIT_S)  # a timer still running would mark it expired
    assert not silence.expired
    with pytest.raises(ValueError, match="engine"), Silence(LIMIT_S):
        raise ValueError("engine said no")
