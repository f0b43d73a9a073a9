"""Measure an engine: the numbers :mod:`.cost_fit` needs, one thing at a time.

1. prefills alone, one size after another (``max_tokens`` 1): time to first token at
   the client, or the engine's prefill time;
2. decode: ``n`` streams started together, at short and at long context; the step
   time while all of them decode (read from the token times, see
   :func:`~.token_times.steady_gap`), or the engine's mean inter-token latency;
3. mixed steps: one decode stream running, single-step prefills sent beside it; the
   step that computed the prefill, read from the decode stream's token times
   (:func:`~.token_times.stall_step`), or the engine's prefill time of that request.

A sample that the token times cannot read (tokens delivered in bursts) is dropped
with a warning; a shape needs one sample to count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from loadtests.engine_io import EngineInfo, EngineIOError, PromptMaker, TokenLog, engine_info
from loadtests.probe.calibrate.token_times import (
    Kind,
    Measurement,
    WindowError,
    median_of,
    prefill_steps,
    stall_step,
    steady_gap,
)
from loadtests.probe.calibrate.wire import (
    INTER_TOKEN,
    PREFILL_TIME,
    EngineClock,
    MeasurementError,
    stream,
    time_to_first_token,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to measure. ``budget`` is the engine's ``--max-num-batched-tokens``;
    ``engine_clock`` reads times from the engine's histograms (:class:`EngineClock`)."""

    budget: int
    prefill_sizes: tuple[int, ...] = (32, 128, 512, 1024, 2048, 3072, 4096)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    short_prompt_tokens: int = 16
    long_context_tokens: int = 1024
    long_context_batches: tuple[int, ...] = (1, 4)
    mixed_sizes: tuple[int, ...] = (64, 256, 1024)
    boundary_steps: int = 2  # prefill sizes added at m·budget and m·budget + 8, m up to it
    skip_tokens: int = 4  # a decode stream's first tokens, not timed (the batch ramps up)
    baseline_gaps: int = 8  # decode gaps before a mixed step that give the ordinary step
    after_tokens: int = 4  # decode tokens after a mixed step that place the stall's end
    decode_window: int = 24  # decode tokens timed per stream, after the skipped ones
    repeats: int = 3
    engine_clock: bool = False

    def __post_init__(self) -> None:
        if self.budget < 4 or self.repeats < 1:
            raise ValueError("the step budget must be at least 4 and repeats at least 1")

    def within(self, max_model_len: int) -> Plan:
        """The plan cut to what fits the engine's context and step budget, with prompt
        sizes on both sides of the first step boundaries added: a prompt of ``m·B + 8``
        tokens takes one step more than one of ``m·B``, which is what tells the fixed
        cost of a step from the request's own overhead (both paid once by a one-step
        prompt)."""
        room = max_model_len - 2
        largest = min(max(self.prefill_sizes), room)
        edges = [m * self.budget + d for m in range(1, self.boundary_steps + 1) for d in (0, 8)]
        decode_room = max_model_len - self.skip_tokens - self.decode_window - 64
        long_context = max(1, min(self.long_context_tokens, decode_room // 2))
        return replace(
            self,
            prefill_sizes=_sizes([*self.prefill_sizes, *(e for e in edges if e <= largest)], room),
            long_context_tokens=long_context,
            long_context_batches=tuple(
                n for n in self.long_context_batches if self.ramp_free(n, long_context)
            ),
            mixed_sizes=_sizes(self.mixed_sizes, min(room, self.budget - 2)),
        )

    def ramp_free(self, batch: int, prompt_tokens: int) -> bool:
        """Whether the engine's clock can time this decode shape: its histograms average
        every token, so the streams must start decoding together (one step admits all
        their prompts). The client's clock reads a window and needs no such thing."""
        return not self.engine_clock or batch == 1 or batch * prompt_tokens <= self.budget


def _sizes(sizes: Sequence[int], limit: int) -> tuple[int, ...]:
    return tuple(sorted({max(1, min(s, limit)) for s in sizes}))


# -- the three kinds of measurement -------------------------------------------------


@dataclass
class Session:
    """A client bound to one engine and a plan, with its prompt maker and, when the
    plan says so, the engine's clock."""

    client: httpx.AsyncClient
    info: EngineInfo
    plan: Plan
    prompts: PromptMaker
    clock: EngineClock | None = None


async def measure_prefills(s: Session) -> list[Measurement]:
    samples: dict[int, list[Measurement]] = {}
    sizes = s.plan.prefill_sizes
    for r in range(s.plan.repeats):
        for size in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
            prompt = await s.prompts.make(size)
            before = await s.clock.read() if s.clock else None
            seconds, _ = await time_to_first_token(s.client, s.info.model, prompt)
            if s.clock and before is not None:
                seconds, _ = await s.clock.since(before, PREFILL_TIME, 1)
            m = Measurement(
                kind=Kind.PREFILL,
                seconds=seconds,
                prompt_tokens=size,
                prefill_steps=prefill_steps(size, s.plan.budget),
                engine_clock=s.clock is not None,
            )
            samples.setdefault(size, []).append(m)
            logger.info("prefill %d tokens: %.2f ms", size, seconds * 1e3)
    return _medians(samples, sizes, "prefill")


async def measure_decodes(s: Session) -> list[Measurement]:
    shapes = [(n, s.plan.short_prompt_tokens) for n in s.plan.decode_batches]
    shapes += [(n, s.plan.long_context_tokens) for n in s.plan.long_context_batches]
    samples: dict[tuple[int, int], list[Measurement]] = {}
    for _ in range(s.plan.repeats):
        for batch, prompt_tokens in shapes:
            try:
                m = await _decode_once(s, batch, prompt_tokens)
            except WindowError as exc:
                logger.warning("decode x%d: sample dropped: %s", batch, exc)
                continue
            samples.setdefault((batch, prompt_tokens), []).append(m)
            logger.info(
                "decode x%d at %d-token prompts: step %.2f ms",
                batch,
                prompt_tokens,
                m.seconds * 1e3,
            )
    return _medians(samples, shapes, "decode")


async def _decode_once(s: Session, batch: int, prompt_tokens: int) -> Measurement:
    plan = s.plan
    ramp = math.ceil(batch * prompt_tokens / plan.budget) + 1
    max_tokens = plan.skip_tokens + plan.decode_window + ramp + 1
    prompts = [await s.prompts.make(prompt_tokens) for _ in range(batch)]
    before = await s.clock.read() if s.clock else None
    logs = await asyncio.gather(*(stream(s.client, s.info.model, p, max_tokens) for p in prompts))
    if s.clock and before is not None:
        # Every token after the first, of every stream: steps of the whole batch.
        total, count = await s.clock.since(before, INTER_TOKEN, batch * (max_tokens - 1))
        seconds, context = total / count, batch * (prompt_tokens + max_tokens / 2)
    else:
        times = [g.times for g in logs]
        seconds, context = steady_gap(times, [prompt_tokens] * batch, skip=plan.skip_tokens)
    return Measurement(
        kind=Kind.DECODE,
        seconds=seconds,
        prompt_tokens=prompt_tokens,
        batch=batch,
        context_tokens=context,
        engine_clock=s.clock is not None,
    )


async def measure_mixed(s: Session) -> list[Measurement]:
    samples: dict[int, list[Measurement]] = {}
    for r in range(s.plan.repeats):
        sizes = s.plan.mixed_sizes
        order = sizes[r % len(sizes) :] + sizes[: r % len(sizes)]
        for m in await _mixed_round(s, order):
            samples.setdefault(m.prompt_tokens, []).append(m)
            logger.info(
                "mixed: %d-token prefill beside a decode: step %.2f ms",
                m.prompt_tokens,
                m.seconds * 1e3,
            )
    return _medians(samples, s.plan.mixed_sizes, "mixed")


def _medians(
    samples: Mapping[Any, list[Measurement]], shapes: Sequence[Any], kind: str
) -> list[Measurement]:
    """The median of each shape that has samples; raises if none has."""
    found = [median_of(samples[shape]) for shape in shapes if samples.get(shape)]
    if not found:
        raise MeasurementError(
            f"no usable {kind} sample: tokens came in bursts, not step by step"
            " (is the engine's machine overloaded? --clock engine may help)"
        )
    return found


async def _mixed_round(s: Session, sizes: Sequence[int]) -> list[Measurement]:
    """One decode stream, each size of prefill sent beside it in turn."""
    plan, model = s.plan, s.info.model
    decode_prompt = plan.short_prompt_tokens
    max_tokens = min(s.info.max_model_len - decode_prompt - 1, 4096)
    log = TokenLog()
    task = asyncio.create_task(
        stream(s.client, model, await s.prompts.make(decode_prompt), max_tokens, log)
    )
    out: list[Measurement] = []
    try:
        await log.wait_for(plan.skip_tokens)
        for size in sizes:
            m = await _beside(s, log, size)
            if m is not None:
                out.append(m)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, EngineIOError):
            await task
    return out


async def _beside(s: Session, log: TokenLog, size: int) -> Measurement | None:
    """One prefill of ``size`` tokens sent beside the decode stream ``log`` records."""
    plan = s.plan
    prompt = await s.prompts.make(size)
    # Ordinary steps before the prefill, for the baseline; send just after a token.
    await log.wait_for(len(log.times) + plan.baseline_gaps + 2)
    before = await s.clock.read() if s.clock else None
    _, at = await time_to_first_token(s.client, s.info.model, prompt)
    await log.wait_for(sum(1 for t in log.times if t <= at) + plan.after_tokens + 1)
    if s.clock and before is not None:
        j = sum(1 for t in log.times if t <= at)
        seconds, _ = await s.clock.since(before, PREFILL_TIME, 1)
    else:
        try:
            j, seconds = stall_step(
                log.times, at, baseline_gaps=plan.baseline_gaps, after=plan.after_tokens
            )
        except WindowError as exc:
            logger.warning("mixed %d: sample dropped: %s", size, exc)
            return None
    return Measurement(
        kind=Kind.MIXED,
        seconds=seconds,
        prompt_tokens=size,
        batch=1,
        context_tokens=plan.short_prompt_tokens + j,
        engine_clock=s.clock is not None,
    )


@dataclass(frozen=True)
class Measured:
    info: EngineInfo
    plan: Plan
    measurements: tuple[Measurement, ...]
    seconds: float


async def measure_engine(
    client: httpx.AsyncClient,
    plan: Plan,
    *,
    model: str | None = None,
    seed: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Measured:
    """Every measurement of ``plan`` against the engine behind ``client``."""
    started = time.perf_counter()
    info = await engine_info(client, model, cache_config=True)
    session = Session(
        client,
        info,
        plan.within(info.max_model_len),
        PromptMaker(client, info.model, random.Random(seed)),
        EngineClock(client) if plan.engine_clock else None,
    )
    await _warm_up(session)
    found: list[Measurement] = []
    for name, step in (
        ("prefill", measure_prefills),
        ("decode", measure_decodes),
        ("mixed", measure_mixed),
    ):
        if progress is not None:
            progress(f"measuring {name} ...")
        found += await step(session)
    return Measured(info, session.plan, tuple(found), time.perf_counter() - started)


async def _warm_up(s: Session) -> None:
    """A few requests whose times are thrown away (first-use costs, connections)."""
    for size in (s.plan.short_prompt_tokens, s.plan.prefill_sizes[-1]):
        await time_to_first_token(s.client, s.info.model, await s.prompts.make(size))
    with contextlib.suppress(WindowError):
        await _decode_once(s, min(4, max(s.plan.decode_batches)), s.plan.short_prompt_tokens)
