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
import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from loadtests.probe import timeline
from loadtests.probe.analysis import analyze
from loadtests.probe.measurements import Injection, unsettled_sizes
from loadtests.probe.result import EngineInfo, ProbeResult

logger = logging.getLogger(__name__)

# Tokens left free under max_model_len, for the largest prompt and the stream's prompt.
HEADROOM_TOKENS = 64
DEFAULT_FIRST_SIZE = 128
MIN_SIZES = 5

_WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name "
    "president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education river garden window letter"
).split()


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
    cards = (await _get_json(client, "/v1/models")).get("data") or []
    if config.model is not None:
        cards = [c for c in cards if c.get("id") == config.model]
    if not cards:
        wanted = f"model {config.model!r}" if config.model else "any model"
        raise ProbeError(f"{config.engine_url} serves {wanted} not at all (GET /v1/models)")
    card = cards[0]
    max_model_len = card.get("max_model_len")
    if not isinstance(max_model_len, int):
        raise ProbeError(f"{config.engine_url} does not say its model's max_model_len")
    return EngineInfo(url=config.engine_url, model=str(card["id"]), max_model_len=max_model_len)


def _check_sizes(sizes: Sequence[int], engine: EngineInfo) -> None:
    too_big = [s for s in sizes if s > engine.max_model_len - HEADROOM_TOKENS]
    if too_big:
        raise ProbeError(
            f"prompt sizes {too_big} do not fit the engine's max_model_len "
            f"{engine.max_model_len} (less {HEADROOM_TOKENS} tokens of headroom)"
        )
    if len(set(sizes)) < MIN_SIZES:
        raise ProbeError(f"need at least {MIN_SIZES} distinct prompt sizes, got {sorted(sizes)}")


class PromptMaker:
    """Prompts of an exact number of tokens, each unique from its first token on."""

    def __init__(self, client: httpx.AsyncClient, model: str, rng: random.Random) -> None:
        self._client = client
        self._model = model
        self._rng = rng
        self._tokens_per_word = 1.5

    def text(self, words: int) -> str:
        tag = f"{self._rng.getrandbits(48):012x}"
        return tag + " " + " ".join(self._rng.choice(_WORDS) for _ in range(words))

    async def make(self, tokens: int) -> list[int]:
        """Token ids of a fresh random text, cut to exactly ``tokens``."""
        words = math.ceil(tokens / self._tokens_per_word * 1.1) + 8
        for _ in range(6):
            ids = await self.tokenize(self.text(words))
            self._tokens_per_word = max(0.1, len(ids) / (words + 1))
            if len(ids) >= tokens:
                return ids[:tokens]
            words = math.ceil(words * 1.5)
        raise ProbeError(f"could not build a {tokens}-token prompt through /tokenize")

    async def tokenize(self, text: str) -> list[int]:
        body = await _post_json(self._client, "/tokenize", {"model": self._model, "prompt": text})
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ProbeError("/tokenize answered without a list of token ids")
        return tokens


class _Arrivals:
    """Arrival times of a decode stream's tokens, and a way to wait for more."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.error: BaseException | None = None
        self.ended = False
        self._changed = asyncio.Event()

    def add(self, t: float) -> None:
        self.times.append(t)
        self._changed.set()

    def end(self, error: BaseException | None = None) -> None:
        self.ended, self.error = True, error
        self._changed.set()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            if self.error is not None:
                raise ProbeError(f"the decode stream failed: {self.error!r}") from self.error
            if self.ended:
                raise ProbeError(f"the decode stream ended after {len(self.times)} tokens")
            self._changed.clear()
            await self._changed.wait()


async def measure(
    client: httpx.AsyncClient,
    engine: EngineInfo,
    prompt_ids: list[int],
    config: ProbeConfig,
    clock: Callable[[], float],
) -> Injection:
    """Inject one prompt beside a fresh decode stream and time what the stream saw."""
    arrivals = _Arrivals()
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
            await _raise_for_status(response)
            reader = asyncio.create_task(_read(response, arrivals, clock))
            try:
                await arrivals.wait_until(lambda: len(arrivals.times) > config.settle_tokens)
                sent = clock()
                await _post_json(client, "/v1/completions", _one_token(engine, prompt_ids))
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


async def _read(response: httpx.Response, arrivals: _Arrivals, clock: Callable[[], float]) -> None:
    """Record the arrival of every token event until the stream ends or fails."""
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            now = clock()
            choices = json.loads(data).get("choices") or []
            if choices:
                arrivals.add(now)
            if any(c.get("finish_reason") for c in choices):
                break
    except (httpx.HTTPError, ValueError) as exc:
        arrivals.end(exc)
        return
    arrivals.end()


async def _get_json(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    response = await client.get(path)
    await _raise_for_status(response)
    return _json_object(response, path)


async def _post_json(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(path, json=body)
    await _raise_for_status(response)
    return _json_object(response, path)


async def _raise_for_status(response: httpx.Response) -> None:
    if response.is_success:
        return
    text = (await response.aread()).decode(errors="replace")[:300]
    raise ProbeError(
        f"{response.request.method} {response.url.path}: {response.status_code} {text}"
    )


def _json_object(response: httpx.Response, path: str) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError as exc:
        raise ProbeError(f"{path} answered with something other than JSON") from exc
    if not isinstance(body, dict):
        raise ProbeError(f"{path} answered with JSON that is not an object")
    return body
