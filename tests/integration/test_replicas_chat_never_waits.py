"""Chat never waits on the shared budget's store; batch does.

The proxy runs in front of a real simulated engine with a ledger that the test can
freeze: every call to it waits until the test lets go (a store that hangs, the
worst case; a slow one only waits less). While it is frozen, chat requests are
answered and a batch request is not; once it lets go, the batch request is answered.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import pytest

from proxy.replicas import Verdict, granted
from proxy.scheduler import ReplicaLoad, Reservation

from .proxyserver import engine, run_proxy
from .simserver import MODEL, SimServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class FrozenLedger:
    """A ledger with no other replica; each call waits while ``frozen`` is set."""

    def __init__(self) -> None:
        self.frozen = threading.Event()
        self.reservations = 0

    async def _wait(self) -> None:
        while self.frozen.is_set():  # noqa: ASYNC110 - set from the test's thread
            await asyncio.sleep(0.01)

    async def open(self) -> None:
        await self._wait()

    async def close(self) -> None:
        pass

    async def publish(self, loads: Mapping[str, ReplicaLoad]) -> dict[str, ReplicaLoad]:
        await self._wait()
        return {}

    async def reserve(self, engine: str, reservation: Reservation) -> Verdict:
        await self._wait()
        self.reservations += 1
        return Verdict(granted(reservation, ReplicaLoad()), ReplicaLoad())


def test_chat_is_answered_while_the_store_hangs_and_batch_waits(sim: SimServer) -> None:
    ledger = FrozenLedger()
    with (
        run_proxy([engine(sim.base_url, "a")], ledger=ledger) as proxy,
        ThreadPoolExecutor(1) as pool,
    ):
        ledger.frozen.set()
        body = {"model": MODEL, "prompt": "one record", "max_tokens": 5}
        batch = pool.submit(proxy.http.post, "/batch/v1/completions", json=body, timeout=30)
        for n in range(5):
            chat = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {n}"}],
                    "max_tokens": 5}  # fmt: skip
            assert proxy.http.post("/v1/chat/completions", json=chat).status_code == 200
        assert not batch.done(), "batch work was sent without its reservation"
        assert ledger.reservations == 0
        ledger.frozen.clear()
        assert batch.result(timeout=30).status_code == 200
        assert ledger.reservations == 1
