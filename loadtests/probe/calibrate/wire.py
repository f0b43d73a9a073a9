"""The engine over HTTP, as calibration asks it: streams of exact-length prompts and
the engine's own clock.

Prompts are token ids from :class:`loadtests.engine_io.PromptMaker`, sent to
``/v1/completions``. Requests stream with ``stream_options.include_usage`` (and
``continuous_usage_stats``, so an engine that packs several tokens in one chunk says
how many) and ``ignore_eos``. Token times are ``time.perf_counter`` at this client.

:class:`EngineClock` reads the engine's own step timings instead: the sums and
counts of vLLM's ``request_prefill_time_seconds`` (first scheduled to first token)
and ``inter_token_latency_seconds`` histograms, which vLLM takes from engine-core
timestamps, so a slow API server that delivers tokens in bursts does not blur them.
``whoseturn sim`` keeps the same histograms in model time.

The only I/O is the ``httpx.AsyncClient`` handed in; its base URL is the engine's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from loadtests.engine_io import EngineIOError, TokenLog, check_status, record_tokens, samples


class MeasurementError(EngineIOError):
    """The engine answered something calibration cannot use."""


async def stream(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    log: TokenLog | None = None,
) -> TokenLog:
    """Run one streamed completion to its end; the log holds its token times."""
    log = log or TokenLog()
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            await check_status(response)
            await record_tokens(response, log, time.perf_counter)
    finally:
        log.close()
    if log.error is not None:
        raise MeasurementError(f"the stream failed: {log.error!r}") from log.error
    if len(log.times) != max_tokens:
        raise MeasurementError(f"asked for {max_tokens} tokens, got {len(log.times)}")
    return log


async def time_to_first_token(
    client: httpx.AsyncClient, model: str, prompt: list[int]
) -> tuple[float, float]:
    """A one-token request: (seconds to its token, ``perf_counter`` when it came)."""
    start = time.perf_counter()
    log = await stream(client, model, prompt, 1)
    return log.times[0] - start, log.times[0]


# -- the engine's own clock -----------------------------------------------------------

PREFILL_TIME = "vllm:request_prefill_time_seconds"
INTER_TOKEN = "vllm:inter_token_latency_seconds"
Histograms = dict[str, tuple[float, float]]
"""Histogram name -> (sum, count), summed over label sets."""


class EngineClock:
    """Step timings from the engine's /metrics histograms, as differences of readings."""

    def __init__(self, client: httpx.AsyncClient, *, settle_s: float = 2.0) -> None:
        self._client = client
        self._settle_s = settle_s

    async def read(self) -> Histograms:
        response = await self._client.get("/metrics")
        await check_status(response)
        found = samples(response.text)
        return {
            name: (found.get(f"{name}_sum", 0.0), found.get(f"{name}_count", 0.0))
            for name in (PREFILL_TIME, INTER_TOKEN)
        }

    async def since(self, before: Histograms, name: str, count: int) -> tuple[float, int]:
        """(sum, count) added to ``name`` since ``before``, once ``count`` were added.

        An engine records a request's timings when it finishes, a moment after its last
        token was sent; this waits up to ``settle_s`` for them. Raises
        :class:`MeasurementError` if they never come (an engine without the histogram).
        """
        deadline = time.monotonic() + self._settle_s
        while True:
            total, seen = (await self.read())[name]
            added = round(seen - before[name][1])
            if added >= count:
                return total - before[name][0], added
            if time.monotonic() > deadline:
                raise MeasurementError(
                    f"{name}: {added} of {count} observations after {self._settle_s} s"
                    " (does the engine export it?)"
                )
            await asyncio.sleep(0.01)
