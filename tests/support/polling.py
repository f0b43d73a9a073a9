"""Waiting for a condition, in a thread or in an event loop."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio


def wait_for(
    predicate: Callable[[], bool],
    timeout: float = 5.0,
    *,
    what: str = "condition",
    interval_s: float = 0.002,
) -> float:
    """Poll ``predicate()`` every ``interval_s`` until it holds; returns the seconds it
    took. Fails the test (:class:`AssertionError` naming ``what``) after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(interval_s)
    return time.monotonic() - start


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` (state in another thread or task) until it holds, without
    blocking the event loop for long; fails after ``timeout_s``."""
    with anyio.fail_after(timeout_s):
        while True:
            if predicate():
                return
            await anyio.sleep(0.002)
