"""The engine over HTTP: what it serves, prompts of exact lengths, token times, and
the engine's own clock.

Prompts are sent as token ids to ``/v1/completions``: random words with a fresh
nonce in front, run through the engine's ``/tokenize`` and cut to the exact length,
so no two prompts share a prefix-cache block. Requests stream with
``stream_options.include_usage`` (and ``continuous_usage_stats``, so an engine that
packs several tokens in one chunk says how many) and ``ignore_eos``. Token times are
``time.perf_counter`` at this client.

:class:`EngineClock` reads the engine's own step timings instead: the sums and
counts of vLLM's ``request_prefill_time_seconds`` (first scheduled to first token)
and ``inter_token_latency_seconds`` histograms, which vLLM takes from engine-core
timestamps, so a slow API server that delivers tokens in bursts does not blur them.
``whoseturn sim`` keeps the same histograms in model time.

The only I/O is the ``httpx.AsyncClient`` handed in; its base URL is the engine's.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_WORDS = (
    "time line data file list name value order table field model stream token queue "
    "engine server client window module class method object string number error event "
    "state step batch cache block prompt answer request reply signal thread socket"
).split()


class MeasurementError(RuntimeError):
    """The engine answered something calibration cannot use."""


@dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """What the engine says about itself (``/v1/models``, ``/metrics``)."""

    url: str
    model: str
    max_model_len: int
    block_size: int | None = None
    num_gpu_blocks: int | None = None


# -- the engine ----------------------------------------------------------------------


async def engine_info(client: httpx.AsyncClient, model: str | None = None) -> EngineInfo:
    """The served model (the first listed unless ``model`` is given) and its limits."""
    response = await client.get("/v1/models")
    _check(response)
    cards = response.json().get("data") or []
    card = next((c for c in cards if model in (None, c.get("id"))), None)
    if card is None:
        raise MeasurementError(f"the engine does not serve {model or 'any model'}")
    max_len = card.get("max_model_len")
    if not isinstance(max_len, int):
        raise MeasurementError("/v1/models gives no max_model_len")
    block_size, num_blocks = await _cache_config(client)
    return EngineInfo(
        url=str(client.base_url).rstrip("/"),
        model=str(card["id"]),
        max_model_len=max_len,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
    )


async def _cache_config(client: httpx.AsyncClient) -> tuple[int | None, int | None]:
    """``block_size`` and ``num_gpu_blocks`` from ``vllm:cache_config_info``, if any."""
    try:
        response = await client.get("/metrics")
        response.raise_for_status()
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError):
        return None, None
    for family in families:
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                labels = sample.labels
                return _int(labels.get("block_size")), _int(labels.get("num_gpu_blocks"))
    return None, None


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() and int(text) > 0 else None


def _check(response: httpx.Response) -> None:
    if response.status_code != 200:
        raise MeasurementError(
            f"{response.request.method} {response.request.url.path} answered "
            f"{response.status_code}: {response.text[:300]}"
        )


# -- prompts and streams --------------------------------------------------------------


class Prompts:
    """Unique prompts of exact token lengths, tokenised by the engine itself."""

    def __init__(self, client: httpx.AsyncClient, model: str, seed: int | None = None) -> None:
        self._client = client
        self._model = model
        self._rng = random.Random(seed)

    async def make(self, tokens: int) -> list[int]:
        words = tokens
        while True:
            text = " ".join([f"{self._rng.getrandbits(48):x}", *self._words(words)])
            body = {"model": self._model, "prompt": text, "add_special_tokens": False}
            response = await self._client.post("/tokenize", json=body)
            _check(response)
            ids = response.json()["tokens"]
            if len(ids) >= tokens:
                return [int(i) for i in ids[:tokens]]
            words = 2 * words + 8

    def _words(self, n: int) -> list[str]:
        return [self._rng.choice(_WORDS) for _ in range(n)]


class TokenLog:
    """Arrival times (``time.perf_counter``) of one stream's tokens, as they come."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.closed = False
        self._changed = asyncio.Event()

    def add(self, count: int, at: float) -> None:
        while len(self.times) < count:
            self.times.append(at)
        self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def wait_for(self, count: int) -> None:
        """Until the stream has ``count`` tokens; raises if it ends before."""
        while len(self.times) < count:
            if self.closed:
                raise MeasurementError(f"a stream ended with {len(self.times)} of {count} tokens")
            self._changed.clear()
            await self._changed.wait()


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
            if response.status_code != 200:
                await response.aread()
                _check(response)
            async for line in response.aiter_lines():
                if _on_line(line, log):
                    break
    finally:
        log.close()
    if len(log.times) != max_tokens:
        raise MeasurementError(f"asked for {max_tokens} tokens, got {len(log.times)}")
    return log


def _on_line(line: str, log: TokenLog) -> bool:
    """Record the tokens of one SSE line; True at ``[DONE]``."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    now = time.perf_counter()
    chunk = json.loads(data)
    if not chunk.get("choices"):
        return False
    usage = chunk.get("usage")
    count = usage.get("completion_tokens") if isinstance(usage, dict) else None
    log.add(count if isinstance(count, int) else len(log.times) + 1, now)
    return False


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
        _check(response)
        found: Histograms = {PREFILL_TIME: (0.0, 0.0), INTER_TOKEN: (0.0, 0.0)}
        for family in text_string_to_metric_families(response.text):
            if family.name not in found:
                continue
            total, count = found[family.name]
            for sample in family.samples:
                if sample.name == f"{family.name}_sum":
                    total += sample.value
                elif sample.name == f"{family.name}_count":
                    count += sample.value
            found[family.name] = (total, count)
        return found

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
