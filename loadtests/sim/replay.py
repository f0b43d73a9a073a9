"""Replay a scripted workload on the simulated engine, in virtual time.

A script lists requests: when each arrives (an offset from the script's start), its
traffic class, its prompt size and its answer length (the model never stops early).
An arm says how they reach one simulated engine: straight in, where the engine's own
policy (FCFS, or priority by class) orders them, or through the proxy's
:class:`~proxy.scheduler.Scheduler` first; and with which engine flags.
:func:`replay` gives, per request, the virtual times of its first token, of its last
and of every output token, so that a benchmark of a real engine can be set beside
the simulator's answer to the same script with a fitted profile: the check of the
simulator's fidelity.

Every prompt has its own content, so the prefix cache never shares a block between
two requests; a replay is pure and deterministic (no I/O, no wall clock).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadtests.sim.drivers import (
    BATCH_PRIORITY,
    INTERACTIVE_PRIORITY,
    ProxyFront,
    Recorder,
    RequestRecord,
    engine_priority,
)
from loadtests.sim.profile import StepCost
from loadtests.sim.step_loop import SimEngine
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.virtual import VirtualRunner
from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.scheduler import Job, TrafficClass
from proxy.scheduler.budget import percentile


@dataclass(frozen=True, kw_only=True)
class ScriptedRequest:
    """One request of a script; the answer is exactly ``max_tokens`` long.

    ``cls`` may be given by name (``"interactive"``, ``"batch"``); any other value is
    a :class:`ValueError`, as are an empty id, a negative or non-finite ``at_s`` and
    a prompt or answer under one token.
    """

    id: str
    at_s: float
    cls: TrafficClass
    prompt_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "cls", TrafficClass(self.cls))
        if not self.id:
            raise ValueError("a scripted request needs a non-empty id")
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ValueError(f"{self.id}: at_s must be a finite offset >= 0, got {self.at_s}")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"{self.id}: prompt_tokens and max_tokens must be at least 1")


@dataclass(frozen=True, kw_only=True)
class ReplayArm:
    """How the script's requests reach the engine, and the engine's flags.

    Under the priority policy a request carries ``interactive_priority`` or
    ``batch_priority`` by class (lower first, as in vLLM), directly or, as the
    proxy's forwarder does, through the proxy; under FCFS it carries 0.
    ``proxy_engine`` (default: ``engine-0`` serving the replay's model with default
    budget settings) and ``scrape_interval_s`` matter only ``through_proxy``.
    """

    name: str
    config: SchedulerConfig
    through_proxy: bool = False
    interactive_priority: int = INTERACTIVE_PRIORITY
    batch_priority: int = BATCH_PRIORITY
    proxy_engine: EngineConfig | None = None
    scrape_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.scrape_interval_s > 0:
            raise ValueError(f"scrape_interval_s must be positive, got {self.scrape_interval_s}")


@dataclass(frozen=True)
class ReplayedRequest:
    """A request's outcome; times are absolute virtual seconds (the script starts at 0)."""

    id: str
    cls: TrafficClass
    at_s: float
    first_token_s: float | None
    finished_s: float | None
    token_times: tuple[float, ...]

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_s is None else self.first_token_s - self.at_s


Submit = Callable[[ScriptedRequest, list[int], float], None]
"""Send a request (with its prompt token ids) on its way at a virtual time."""


def replay(
    script: Sequence[ScriptedRequest],
    arm: ReplayArm,
    cost: StepCost,
    model: str = "tiny",
    *,
    seed: int = 0,
) -> list[ReplayedRequest]:
    """Run ``script`` on one simulated engine under ``arm`` until every request has
    finished; the results are in script order.

    ``model`` is the model the proxy's jobs ask for; ``seed`` draws the prompts'
    token ids. Raises :class:`ValueError` on duplicate ids, on a request whose prompt
    and answer exceed the engine's ``max_model_len`` (vLLM refuses it too), and on a
    proxy engine that does not serve ``model``.
    """
    _check(script, arm, model)
    clock = VirtualClock()
    runner = VirtualRunner(SimEngine(arm.config, cost, clock), clock)
    rec = Recorder()
    runner.listeners.append(rec.listen)
    if arm.through_proxy:
        last_arrival = max((r.at_s for r in script), default=0.0)
        submit = _through_proxy(runner, arm, model, last_arrival)
    else:
        submit = _direct(runner.engine, arm)
    rng = random.Random(seed)
    for index, request in enumerate(script):
        rec.records[request.id] = RequestRecord(request.cls, request.at_s)
        prompt = _prompt(rng, index, request.prompt_tokens)
        runner.call_at(request.at_s, functools.partial(submit, request, prompt))
    runner.run()
    return [_outcome(r, rec.records[r.id]) for r in script]


def ttft_percentiles(results: Sequence[ReplayedRequest], cls: TrafficClass) -> tuple[float, float]:
    """(p50, p95) of time to first token over the requests of ``cls`` that got one
    (nearest rank); :class:`ValueError` when there are none."""
    ttfts = [r.ttft_s for r in results if r.cls is cls and r.ttft_s is not None]
    if not ttfts:
        raise ValueError(f"no {cls.value} request with a first token")
    return percentile(ttfts, 0.50), percentile(ttfts, 0.95)


def _check(script: Sequence[ScriptedRequest], arm: ReplayArm, model: str) -> None:
    seen: set[str] = set()
    for r in script:
        if r.id in seen:
            raise ValueError(f"duplicate request id {r.id!r} in the script")
        seen.add(r.id)
        if r.prompt_tokens + r.max_tokens > arm.config.max_model_len:
            raise ValueError(
                f"{r.id}: {r.prompt_tokens} prompt + {r.max_tokens} answer tokens exceed "
                f"max_model_len {arm.config.max_model_len}"
            )
    if arm.through_proxy and arm.proxy_engine is not None and model not in arm.proxy_engine.models:
        raise ValueError(f"the proxy engine {arm.proxy_engine.name!r} does not serve {model!r}")


def _prompt(rng: random.Random, index: int, n: int) -> list[int]:
    """Token ids no other prompt of the replay shares a block with: the first token
    is the request's own, and block hashes chain from the first block."""
    return [16 + index] + [rng.randrange(16, 32000) for _ in range(n - 1)]


def _priority(arm: ReplayArm, cls: TrafficClass) -> int:
    return engine_priority(
        arm.config, cls, interactive=arm.interactive_priority, batch=arm.batch_priority
    )


def _direct(engine: SimEngine, arm: ReplayArm) -> Submit:
    def submit(request: ScriptedRequest, prompt: list[int], t: float) -> None:
        engine.add_request(
            prompt,
            request.max_tokens,
            request_id=request.id,
            priority=_priority(arm, request.cls),
            arrival_time=t,
        )

    return submit


def _through_proxy(
    runner: VirtualRunner, arm: ReplayArm, model: str, last_arrival: float
) -> Submit:
    settings = arm.proxy_engine or EngineConfig(name="engine-0", models=frozenset({model}))

    def keep_scraping(t: float) -> bool:
        if not front.scheduler.jobs:
            return t < last_arrival
        if not front.engine.has_unfinished_requests:
            # Just scraped and pumped with nothing in flight: nothing will change.
            held = sorted(front.scheduler.jobs)
            raise RuntimeError(f"at {t:.3f} s the engine is idle and the proxy holds {held}")
        return True

    front = ProxyFront(
        runner,
        settings,
        scrape_interval_s=arm.scrape_interval_s,
        keep_scraping=keep_scraping,
        priorities={cls: _priority(arm, cls) for cls in TrafficClass},
    )

    def submit(request: ScriptedRequest, prompt: list[int], t: float) -> None:
        job = Job(
            id=request.id,
            cls=request.cls,
            model=model,
            prompt_tokens=request.prompt_tokens,
            arrival=t,
        )
        front.submit(job, prompt, request.max_tokens)

    return submit


def _outcome(request: ScriptedRequest, record: RequestRecord) -> ReplayedRequest:
    if record.finished is None:
        raise RuntimeError(f"{request.id} did not finish")  # the runner stopped with work left
    return ReplayedRequest(
        id=request.id,
        cls=request.cls,
        at_s=request.at_s,
        first_token_s=record.first_token,
        finished_s=record.finished,
        token_times=tuple(record.token_times),
    )
