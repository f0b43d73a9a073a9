"""The store's health (:mod:`proxy.batch.health`): an outage is noticed once, calls
fail fast while it lasts, calls waiting on a store that stopped answering are let
go at once, and the store is found again by its probe."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from proxy.batch.health import MAX_BACKOFF_S, GuardedStore, StoreDown, StoreHealth
from proxy.batch.sqlite import SQLiteStore

pytestmark = pytest.mark.anyio


def test_an_outage_begins_once_and_ends_with_its_length() -> None:
    health = StoreHealth(probe_s=0.25, since=0.0)
    assert health.down(10.0, "AdminShutdown") is True
    assert health.down(11.0, "again") is False  # the same outage
    assert (health.up, health.cause, health.outages) == (False, "AdminShutdown", 1)
    assert health.view(12.5) == {"up": False, "for_s": 2.5, "cause": "AdminShutdown", "outages": 1}
    assert health.back(14.0) == 4.0
    assert health.back(15.0) is None
    assert health.view(15.0)["up"] is True


def test_the_backoff_doubles_up_to_its_cap() -> None:
    health = StoreHealth(probe_s=0.25)
    health.down(0.0, "x")
    waits = []
    for _ in range(8):
        waits.append(health.backoff_s())
        health.failed_probes += 1
    assert waits[:4] == [0.25, 0.5, 1.0, 2.0]
    assert max(waits) == MAX_BACKOFF_S


class Backend:
    """A store that answers, raises, or never answers, as the test says; it counts
    the calls that reached it."""

    def __init__(self) -> None:
        self.mode = "ok"  # ok, raise, hang
        self.calls = 0

    async def _act(self) -> None:
        self.calls += 1
        if self.mode == "raise":
            raise sqlite3.OperationalError("disk I/O error")
        if self.mode == "hang":
            await anyio.sleep_forever()

    async def open(self) -> None:
        await self._act()

    async def ping(self) -> None:
        await self._act()

    async def get_batch(self, batch_id: str) -> Any:
        await self._act()
        return None

    async def count_by_status(self) -> dict[str, int]:
        await self._act()
        return {}


async def guarded(backend: Backend, timeout_s: float | None = 5.0) -> GuardedStore:
    store = GuardedStore(
        backend,  # type: ignore[arg-type]  # the methods a test calls
        time.monotonic,
        timeout_s=timeout_s,
        outage_errors=(sqlite3.OperationalError,),
        probe_s=0.05,
    )
    await store.open()
    return store


async def test_while_down_calls_fail_at_once_without_reaching_the_store() -> None:
    backend = Backend()
    store = await guarded(backend)
    backend.mode = "raise"
    with pytest.raises(StoreDown) as first:
        await store.get_batch("b")
    assert "OperationalError: disk I/O error" in first.value.cause
    reached = backend.calls
    for _ in range(5):
        with pytest.raises(StoreDown):
            await store.count_by_status()
    assert backend.calls == reached
    assert store.health.outages == 1
    backend.mode = "ok"
    await store.ping()  # the probe goes through, and finds it back
    assert store.health.up
    assert await store.get_batch("b") is None


async def test_a_call_waiting_on_a_silent_store_is_let_go_when_the_outage_is_found() -> None:
    backend = Backend()
    store = await guarded(backend, timeout_s=30.0)
    backend.mode = "hang"
    waited: list[float] = []

    async def ask() -> None:
        began = anyio.current_time()
        with pytest.raises(StoreDown):
            await store.get_batch("b")
        waited.append(anyio.current_time() - began)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(ask)
            group.start_soon(store.watch)  # its ping (0.4 s deadline) finds the outage
            for _ in range(400):
                if waited:
                    break
                await anyio.sleep(0.01)
            group.cancel_scope.cancel()
    assert waited[0] < 1.5, waited  # not the call's own 30 s
    assert "ping" in store.health.cause


async def test_a_quick_call_past_its_deadline_marks_the_store_down() -> None:
    backend = Backend()
    store = await guarded(backend, timeout_s=0.1)
    backend.mode = "hang"
    with anyio.fail_after(5), pytest.raises(StoreDown):
        await store.get_batch("b")
    assert not store.health.up and "within 0.1 s" in store.health.cause


async def test_the_probe_finds_the_store_again_by_itself() -> None:
    backend = Backend()
    store = await guarded(backend)
    backend.mode = "raise"
    with pytest.raises(StoreDown):
        await store.get_batch("b")
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(store.watch)
            await anyio.sleep(0.3)
            assert not store.health.up and store.health.failed_probes >= 1
            backend.mode = "ok"
            for _ in range(400):
                if store.health.up:
                    break
                await anyio.sleep(0.01)
            group.cancel_scope.cancel()
    assert await store.get_batch("b") is None


async def test_errors_that_are_not_outages_pass_through(tmp_path: Path) -> None:
    inner = SQLiteStore(tmp_path / "b.db", time.time)
    store = GuardedStore(
        inner, time.monotonic, timeout_s=None, outage_errors=(sqlite3.OperationalError,)
    )
    await store.open()
    with pytest.raises(OSError):  # a file that is gone is the caller's business
        async with store.local_file("file-missing") as path:
            path.read_bytes()
    assert store.health.up
    await store.close()
    with pytest.raises(StoreDown):  # a closed store does not answer its probe
        await store.ping()
