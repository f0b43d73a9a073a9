"""Calibration's reading of the engine's own clock: differences of its /metrics
histograms, on a mock transport."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from loadtests.probe.calibrate.wire import INTER_TOKEN, PREFILL_TIME, EngineClock, MeasurementError


def histograms(prefill: tuple[float, int], itl: tuple[float, int]) -> str:
    lines = []
    for name, (total, count) in ((PREFILL_TIME, prefill), (INTER_TOKEN, itl)):
        lines += [f"# TYPE {name} histogram"]
        for engine in ("0", "1"):  # two label sets, summed
            labels = f'engine="{engine}",model_name="tiny"'
            lines += [
                f'{name}_bucket{{{labels},le="+Inf"}} {count / 2}',
                f"{name}_count{{{labels}}} {count / 2}",
                f"{name}_sum{{{labels}}} {total / 2}",
            ]
    return "\n".join(lines) + "\n"


def test_engine_clock_reads_histogram_differences_once_they_come() -> None:
    # Before; a reading with nothing new yet (the clock waits); then two prefills.
    pages = iter(
        [
            histograms((1.0, 10), (2.0, 100)),
            histograms((1.0, 10), (2.0, 100)),
            histograms((1.25, 12), (2.5, 110)),
        ]
    )

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=next(pages))

    async def go() -> tuple[float, int]:
        transport = httpx.MockTransport(handle)
        async with httpx.AsyncClient(transport=transport, base_url="http://e") as client:
            clock = EngineClock(client)
            return await clock.since(await clock.read(), PREFILL_TIME, 2)

    total, count = asyncio.run(go())
    assert total == pytest.approx(0.25) and count == 2


def test_engine_clock_gives_up_on_an_engine_without_the_histogram() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="# nothing here\n")

    async def go() -> None:
        transport = httpx.MockTransport(handle)
        async with httpx.AsyncClient(transport=transport, base_url="http://e") as client:
            clock = EngineClock(client, settle_s=0.05)
            await clock.since(await clock.read(), INTER_TOKEN, 1)

    with pytest.raises(MeasurementError, match="does the engine export it"):
        asyncio.run(go())
