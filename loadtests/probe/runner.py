"""The probe's I/O: a decode stream, prompts injected beside it, and the clock.

:func:`run_probe` talks to one OpenAI-compatible engine (vLLM, or ``whoseturn sim``)
over HTTP through one :class:`httpx.AsyncClient`:

1. ``GET /v1/models``: the model and its ``max_model_len``, which caps the prompt sizes;
2. ``POST /tokenize``: prompts of random words, unique from their first token on (so
   the prefix cache cannot help), cut to exactly the wanted number of token ids;
3. for each prompt (an unrecorded warm-up at the smallest and the largest size first,
   then every size ``repeats`` times, ascending and descending in turn, then again
   each size whose repeats disagree, up to ``extra_repeats`` rounds): open a streaming
   completion with a short prompt and a large ``max_tokens`` (``ignore_eos``), let it
   settle, send the prompt with ``max_tokens: 1`` beside it, and keep the stream until
   a few tokens after the prompt was answered. The stream's arrival times give the
   prompt's :class:`Injection` (:mod:`loadtests.probe.timeline`); closing the stream
   aborts it in the engine.

Everything it cannot do (engine unreachable, an HTTP error, a stream that ends too
soon, a timeout) is raised as :class:`ProbeError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from loadtests.engine_io import (
    EngineInfo,
    EngineIOError,
    PromptMaker,
    TokenLog,
    check_status,
    engine_info,
    record_tokens,
)
from loadtests.engine_io.info import post_json
from loadtests.probe import timeline
from loadtests.probe.analysis import analyze
from loadtests.probe.measurements import Injection, unsettled_sizes
from loadtests.probe.result import ProbeResult

logger = logging.getLogger(__name__)

# Tokens left free under max_model_len, for the largest prompt and the stream's prompt.
HEADROOM_TOKENS = 64
DEFAULT_FIRST_SIZE = 128
MIN_SIZES = 5


class ProbeError(Exception):
    """The probe could not measure the engine; the message says why."""


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    engine_url: str
    model: str | None = None
    """Model to ask for; default: the first one ``/v1/models`` lists."""
    sizes: tuple[int, ...] = ()
    """Prompt sizes in tokens; default: :func:`default_sizes` of the engine's context."""
    repeats: int = 3
    extra_repeats: int = 3
    """Rounds of one more measurement of each size whose repeats disagree."""
    settle_tokens: int = 12
    """Decode tokens received before a prompt is sent (the quiet window)."""
    tail_tokens: int = 2
    """Decode tokens received after the prompt is answered, before the stream closes."""
    timeout_s: float = 300.0
    """Limit on any one request and on any one measurement."""
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.extra_repeats < 0:
            raise ValueError("repeats must be at least 1 and extra_repeats at least 0")
        if self.settle_tokens < 3 or self.tail_tokens < 1:
            raise ValueError("settle_tokens must be at least 3 and tail_tokens at least 1")
        if any(size < 1 for size in self.sizes):
            raise ValueError(f"prompt sizes must be positive, got {self.sizes}")


def default_sizes(max_model_len: int) -> tuple[int, ...]:
    """Doubling prompt sizes up to the cap, ``max_model_len - HEADROOM_TOKENS``, which is
    itself the last size: from 128 tokens, or from fewer if that leaves under
    ``MIN_SIZES`` sizes below a short context."""
    cap = max_model_len - HEADROOM_TOKENS
    first = DEFAULT_FIRST_SIZE
    while len(_ladder(first, cap)) < MIN_SIZES and first > 16:
        first //= 2
    return _ladder(first, cap)


def _ladder(first: int, cap: int) -> tuple[int, ...]:
    sizes = []
    size = first
    while size * 1.4 <= cap:
        sizes.append(size)
        size *= 2
    return (*sizes, cap)


async def run_probe(
    config: ProbeConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> ProbeResult:
    """Measure the engine at ``config.engine_url`` and judge it; raises ProbeError."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    started = clock()
    async with httpx.AsyncClient(
        base_url=config.engine_url.rstrip("/"),
        timeout=config.timeout_s,
        headers=headers,
        transport=transport,
    ) as client:
        try:
            return await _probe(client, config, clock, started)
        except EngineIOError as exc:
            raise ProbeError(str(exc)) from exc
        except httpx.HTTPError as exc:
            raise ProbeError(f"cannot talk to {config.engine_url}: {exc!r}") from exc
        except TimeoutError as exc:
            raise ProbeError(f"{config.engine_url} took over {config.timeout_s:.0f} s") from exc


async def _probe(
    client: httpx.AsyncClient, config: ProbeConfig, clock: Callable[[], float], started: float
) -> ProbeResult:
    engine = await discover(client, config)
    sizes = tuple(sorted(set(config.sizes))) or default_sizes(engine.max_model_len)
    _check_sizes(sizes, engine)
    # Fresh entropy on every run: a prompt repeated from an earlier run would be
    # answered from the prefix cache and stall nothing.
    prompts = PromptMaker(client, engine.model, random.Random())
    session = _Session(client=client, engine=engine, config=config, clock=clock, prompts=prompts)
    order = [size for rep in range(config.repeats) for size in sizes[:: 1 if rep % 2 == 0 else -1]]
    logger.info("probing %s with %d prompts of %s tokens", engine.url, len(order), sizes)
    for size in (sizes[0], sizes[-1]):  # warm-up, not recorded: first-use costs
        await session.inject(size)
    injections = [await session.inject(size) for size in order]
    for _ in range(config.extra_repeats):
        again = unsettled_sizes(injections)
        if not again:
            break
        logger.info("measuring %s tokens again: their repeats disagree", again)
        injections += [await session.inject(size) for size in again]
    return ProbeResult(
        engine=engine,
        injections=tuple(injections),
        analysis=analyze(injections),
        elapsed_s=clock() - started,
    )


@dataclass(frozen=True, kw_only=True)
class _Session:
    """What every measurement of one probe run shares."""

    client: httpx.AsyncClient
    engine: EngineInfo
    config: ProbeConfig
    clock: Callable[[], float]
    prompts: PromptMaker

    async def inject(self, size: int) -> Injection:
        """A fresh ``size``-token prompt beside a fresh decode stream."""
        prompt = await self.prompts.make(size)
        injection = await measure(self.client, self.engine, prompt, self.config, self.clock)
        logger.info(
            "%d-token prompt: decode stalled %.1f ms, %d long gaps (the prompt took %.1f ms)",
            size,
            injection.stall_s * 1000,
            injection.prefill_steps,
            injection.prompt_latency_s * 1000,
        )
        return injection


async def discover(client: httpx.AsyncClient, config: ProbeConfig) -> EngineInfo:
    """The model to use and its context length, from ``/v1/models``."""
    try:
        info = await engine_info(client, config.model)
    except EngineIOError as exc:
        raise ProbeError(f"{config.engine_url}: {exc}") from exc
    return dataclasses.replace(info, url=config.engine_url)


def _check_sizes(sizes: Sequence[int], engine: EngineInfo) -> None:
    too_big = [s for s in sizes if s > engine.max_model_len - HEADROOM_TOKENS]
    if too_big:
        raise ProbeError(
            f"prompt sizes {too_big} do not fit the engine's max_model_len "
            f"{engine.max_model_len} (less {HEADROOM_TOKENS} tokens of headroom)"
        )
    if len(set(sizes)) < MIN_SIZES:
        raise ProbeError(f"need at least {MIN_SIZES} distinct prompt sizes, got {sorted(sizes)}")


async def measure(
    client: httpx.AsyncClient,
    engine: EngineInfo,
    prompt_ids: list[int],
    config: ProbeConfig,
    clock: Callable[[], float],
) -> Injection:
    """Inject one prompt beside a fresh decode stream and time what the stream saw."""
    arrivals = TokenLog()
    body = {
        "model": engine.model,
        "prompt": "Count on, one number at a time: 1 2 3",
        "max_tokens": engine.max_model_len - HEADROOM_TOKENS,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    async with asyncio.timeout(config.timeout_s):
        async with client.stream("POST", "/v1/completions", json=body) as response:
            await check_status(response)
            reader = asyncio.create_task(record_tokens(response, arrivals, clock))
            try:
                await arrivals.wait_until(lambda: len(arrivals.times) > config.settle_tokens)
                sent = clock()
                await post_json(client, "/v1/completions", _one_token(engine, prompt_ids))
                answered = clock()
                await arrivals.wait_until(
                    lambda: timeline.tokens_after(arrivals.times, answered) >= config.tail_tokens
                )
            finally:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
    quiet = timeline.quiet_gaps(arrivals.times, sent)
    stall = timeline.stall(arrivals.times, sent, answered)
    threshold = timeline.step_threshold(quiet, stall)
    return Injection(
        prompt_tokens=len(prompt_ids),
        stall_s=stall,
        baseline_gap_s=quiet.median_gap_s,
        quiet_worst_s=quiet.worst_gap_s,
        prompt_latency_s=answered - sent,
        prefill_steps=timeline.long_gaps(arrivals.times, sent, answered, threshold),
    )


def _one_token(engine: EngineInfo, prompt_ids: list[int]) -> dict[str, Any]:
    return {"model": engine.model, "prompt": prompt_ids, "max_tokens": 1, "temperature": 0}
