"""Tenants beside each other in virtual time: the proxy's scheduler in front of one
simulated engine, with no HTTP in between (as :mod:`loadtests.sim.twin` runs chat
beside batch).

Two workloads, both closed loops (a client keeps a number of requests outstanding,
sending the next as one finishes) or open streams (a request every so often):

- :func:`run_tenants`: each tenant's streams, as :class:`TenantLoad` says; the run
  returns every request's record with its tenant, and what the scheduler decided.
- :func:`quiet_beside_noisy`: the issue's "what was seen": a quiet tenant sends a
  short chat every half second; a noisy one keeps 32 long chats in flight. Three
  arms on fresh engines: the quiet tenant alone, beside the noisy one in arrival
  order (fair share off), and beside it with fair share on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadtests.sim.drivers import ProxyFront, Recorder, RequestRecord
from loadtests.sim.profile import Profile, load_profile
from loadtests.sim.settings import scheduler_config
from loadtests.sim.step_loop import SimEngine
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.virtual import VirtualRunner
from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.scheduler import Dispatch, Job, Scheduler, SchedulerSettings, Tier, TrafficClass
from proxy.scheduler.budget import percentile

__all__ = [
    "QuietNoisy",
    "TenantLoad",
    "TenantRecord",
    "quiet_beside_noisy",
    "run_tenants",
]


@dataclass(frozen=True, kw_only=True)
class TenantLoad:
    """One tenant's traffic: ``outstanding`` requests kept in flight (a closed loop)
    from ``start_s`` to ``stop_s``, and/or one request every ``every_s``; each prompt
    ``prompt_tokens`` long (a range: drawn), each answer ``answer_tokens``."""

    name: str
    cls: TrafficClass = TrafficClass.INTERACTIVE
    weight: float = 1.0
    tier: Tier = Tier.STANDARD
    outstanding: int = 0
    every_s: float | None = None
    prompt_tokens: tuple[int, int] = (500, 500)
    answer_tokens: int = 32
    start_s: float = 0.0
    stop_s: float = float("inf")
    flows: int = 1  # batch: the tenant's jobs, its requests spread over them in turn


@dataclass
class TenantRecord(RequestRecord):
    tenant: str = ""
    prompt: int = 0
    answer: int = 0


def run_tenants(
    loads: Sequence[TenantLoad],
    duration_s: float,
    *,
    profile: Profile | None = None,
    engine: EngineConfig | None = None,
    config: SchedulerConfig | None = None,
    settings: SchedulerSettings | None = None,
    seed: int = 0,
    on_dispatch: Callable[[Dispatch], None] | None = None,
) -> tuple[list[TenantRecord], Scheduler]:
    """Run ``loads`` through the proxy's scheduler for ``duration_s`` model seconds;
    every request's record (arrival, first token, finish, tenant) and the scheduler."""
    profile = profile or load_profile("h100-llama3-8b")
    config = config or scheduler_config(profile)
    engine = engine or EngineConfig(name="engine-0", models=frozenset({profile.model}))
    model = next(iter(engine.models))
    clock = VirtualClock()
    runner = VirtualRunner(SimEngine(config, profile.step, clock), clock)
    rec = Recorder()
    runner.listeners.append(rec.listen)
    front = ProxyFront(
        runner,
        engine,
        scrape_interval_s=1.0,
        keep_scraping=lambda t: t < duration_s,
        scheduler_settings=settings,
    )
    if on_dispatch is not None:
        front.on_dispatch.append(on_dispatch)
    rng = random.Random(seed)
    ids = iter(range(10**9))
    turns: dict[str, int] = {}

    def send(load: TenantLoad, t: float) -> None:
        if not load.start_s <= t < min(load.stop_s, duration_s):
            return
        rid = f"{load.name}-{next(ids)}"
        prompt = rng.randint(*load.prompt_tokens)
        record = TenantRecord(
            load.cls, t, tenant=load.name, prompt=prompt, answer=load.answer_tokens
        )
        rec.records[rid] = record
        n = turns[load.name] = turns.get(load.name, 0) + 1
        job = Job(
            id=rid,
            cls=load.cls,
            model=model,
            prompt_tokens=prompt,
            arrival=t,
            tenant=load.name,
            flow=f"job-{n % load.flows}" if load.cls is TrafficClass.BATCH else "",
            weight=load.weight,
            tier=load.tier,
            expected_output=load.answer_tokens,
        )
        tokens = [rng.randrange(16, 32000) for _ in range(prompt)]
        front.submit(job, tokens, load.answer_tokens)

    named = {load.name: load for load in loads}

    def finished(record: RequestRecord, t: float) -> None:
        load = named.get(record.tenant) if isinstance(record, TenantRecord) else None
        if load is not None and load.outstanding:
            send(load, t)

    rec.on_finished = finished
    for load in loads:
        for _ in range(load.outstanding):
            runner.call_at(load.start_s, _sender(send, load))
        if load.every_s:
            t = load.start_s
            while t < min(load.stop_s, duration_s):
                runner.call_at(t, _sender(send, load))
                t += load.every_s
    runner.run()
    records = [r for r in rec.records.values() if isinstance(r, TenantRecord)]
    return records, front.scheduler


def _sender(send: Callable[[TenantLoad, float], None], load: TenantLoad) -> Callable[[float], None]:
    return lambda t: send(load, t)


@dataclass(frozen=True)
class QuietNoisy:
    """One arm of :func:`quiet_beside_noisy`: the quiet tenant's TTFTs (seconds),
    and the noisy tenant's output tokens per second."""

    name: str
    quiet_ttft: list[float] = field(default_factory=list)
    noisy_tokens_per_s: float = 0.0

    @property
    def p50(self) -> float:
        return percentile(self.quiet_ttft, 0.50)

    @property
    def p95(self) -> float:
        return percentile(self.quiet_ttft, 0.95)


QUIET = TenantLoad(name="quiet", every_s=0.5, prompt_tokens=(100, 100), answer_tokens=32)
NOISY = TenantLoad(name="noisy", outstanding=32, prompt_tokens=(3000, 6000), answer_tokens=64)


def quiet_beside_noisy(duration_s: float = 60.0, warmup_s: float = 5.0) -> list[QuietNoisy]:
    """The three arms, each on a fresh engine and scheduler."""
    arms = [
        ("quiet alone", [QUIET], True),
        ("beside noisy, arrival order", [QUIET, NOISY], False),
        ("beside noisy, fair share", [QUIET, NOISY], True),
    ]
    out = []
    for name, loads, fair in arms:
        records, _ = run_tenants(loads, duration_s, settings=SchedulerSettings(fair_share=fair))
        lo, hi = warmup_s, duration_s
        quiet = [
            r.first_token - r.arrival
            for r in records
            if r.tenant == "quiet" and lo <= r.arrival < hi and r.first_token is not None
        ]
        noisy = sum(
            r.answer
            for r in records
            if r.tenant == "noisy" and r.finished and lo <= r.finished < hi
        )
        out.append(QuietNoisy(name, quiet, noisy / (hi - lo)))
    return out


def shares_1_1_2(cls: TrafficClass, duration_s: float = 40.0) -> dict[str, float]:
    """Three tenants of weights 1, 1 and 2, each backlogged: their shares of the
    prompt and output tokens that reached a first token (chat, behind a cap of 8)
    or of the prompt tokens admitted (batch) from 10 s to the end."""
    served: dict[str, float] = {}
    engine = None
    if cls is TrafficClass.INTERACTIVE:
        engine = EngineConfig(name="engine-0", models=frozenset({"llama-3-8b"}), max_inflight=8)
    outstanding = 24 if cls is TrafficClass.INTERACTIVE else 64
    prompt = (400, 600) if cls is TrafficClass.INTERACTIVE else (1000, 3000)
    loads = [
        TenantLoad(name=n, cls=cls, weight=w, outstanding=outstanding, prompt_tokens=prompt)
        for n, w in (("a", 1.0), ("b", 1.0), ("c", 2.0))
    ]

    def seen(d: Dispatch) -> None:
        if d.at >= 10:
            served[d.job.tenant] = served.get(d.job.tenant, 0.0) + d.job.prompt_tokens

    run_tenants(loads, duration_s, engine=engine, on_dispatch=seen)
    total = sum(served.values())
    return {n: v / total for n, v in sorted(served.items())}


def main() -> None:
    """Print the virtual-time figures docs/scheduling.md quotes."""
    from loadtests.support.markdown import markdown_table

    arms = quiet_beside_noisy()
    alone = arms[0]
    rows = [
        [
            a.name,
            f"{a.p50 * 1000:.0f}",
            f"{a.p95 * 1000:.0f}",
            f"{a.p95 / alone.p95:.1f}x",
            f"{a.noisy_tokens_per_s:.0f}",
        ]
        for a in arms
    ]
    header = ["arm", "quiet TTFT p50 ms", "p95 ms", "p95 / alone", "noisy output tok/s"]
    print(markdown_table(header, rows))
    for cls in TrafficClass:
        got = shares_1_1_2(cls)
        print(
            f"{cls.value} shares, weights 1:1:2: "
            + ", ".join(f"{n} {v:.3f}" for n, v in got.items())
        )


if __name__ == "__main__":
    main()
