"""Work cancelled the moment its client hangs up.

A request's work (waiting in the queue, then relaying the engine's answer) must
stop, and its upstream request be aborted, as soon as the client disconnects; the
ASGI server says so only through ``receive()`` (``http.disconnect``). So while the
work runs, a watcher task waits on ``receive()`` and cancels the work's scope.

The watcher is a bare asyncio task, not a task in an anyio task group: anyio makes
a task handle, an event and a cancel scope for each task it starts, and a request
started two such watchers (its wait, then its relay), ~10 % of its CPU
(docs/overhead.md). The task is cancelled when the work ends, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import anyio
from starlette.types import Receive

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while the proxy was working on its request."""


@contextmanager
def cancelled_on_disconnect(receive: Receive) -> Iterator[anyio.CancelScope]:
    """A scope around the caller's block, cancelled when ``receive`` says the client
    disconnected (:attr:`~anyio.CancelScope.cancelled_caught` then says so)."""
    with anyio.CancelScope() as scope:
        watcher = asyncio.ensure_future(_watch(receive, scope))
        try:
            yield scope
        finally:
            watcher.cancel()


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client hangs up first (then it is cancelled and
    :class:`ClientGone` raised)."""
    box: list[T] = []
    with cancelled_on_disconnect(receive):
        box.append(await work)
    if not box:
        raise ClientGone
    return box[0]


async def _watch(receive: Receive, scope: anyio.CancelScope) -> None:
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception as exc:  # the server's receive failed: nothing left to watch
        logger.debug("disconnect watcher stopped: %s", exc)
        return
    scope.cancel()
