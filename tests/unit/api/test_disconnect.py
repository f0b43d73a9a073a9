"""Work cancelled the moment its client hangs up (:mod:`proxy.api.disconnect`)."""

from __future__ import annotations

import anyio
import pytest
from starlette.types import Message

from proxy.api.disconnect import ClientGone, cancelled_on_disconnect, until_disconnect

pytestmark = pytest.mark.anyio


class Client:
    """An ASGI ``receive`` that says nothing until :meth:`hang_up`, and notes a
    watcher that stopped waiting on it."""

    def __init__(self) -> None:
        self.gone = anyio.Event()
        self.waiting = 0
        self.cancelled = 0

    def hang_up(self) -> None:
        self.gone.set()

    async def receive(self) -> Message:
        self.waiting += 1
        try:
            await self.gone.wait()
        except BaseException:
            self.cancelled += 1
            raise
        finally:
            self.waiting -= 1
        return {"type": "http.disconnect"}


async def test_work_done_before_a_hang_up_returns_its_value_and_stops_the_watcher() -> None:
    client = Client()

    async def work() -> str:
        await anyio.sleep(0.01)
        return "answer"

    assert await until_disconnect(client.receive, work()) == "answer"
    await anyio.sleep(0.01)
    assert client.waiting == 0 and client.cancelled == 1


async def test_a_hang_up_cancels_the_work_at_once() -> None:
    client = Client()
    cancelled = anyio.Event()

    async def work() -> str:
        try:
            await anyio.sleep(30)
        finally:
            cancelled.set()
        return "never"

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(_hang_up_soon, client)
            with pytest.raises(ClientGone):
                await until_disconnect(client.receive, work())
    assert cancelled.is_set()


async def test_the_works_own_error_passes_through() -> None:
    client = Client()

    async def work() -> str:
        raise ValueError("engine said no")

    with pytest.raises(ValueError, match="engine said no"):
        await until_disconnect(client.receive, work())
    await anyio.sleep(0.01)
    assert client.waiting == 0


async def test_the_scope_says_whether_the_client_left() -> None:
    client = Client()
    with cancelled_on_disconnect(client.receive) as scope:
        await anyio.sleep(0.01)
    assert not scope.cancelled_caught
    client.hang_up()
    with cancelled_on_disconnect(client.receive) as scope:
        await anyio.sleep(30)
    assert scope.cancelled_caught


async def _hang_up_soon(client: Client) -> None:
    await anyio.sleep(0.02)
    client.hang_up()
