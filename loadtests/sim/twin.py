"""The digital twin: chat beside a batch job, direct or through the proxy's scheduler,
on simulated engines in virtual time.

The same :class:`proxy.scheduler.Scheduler` code that runs in the proxy decides
here, on the same virtual clock as the engine model, with no HTTP in between, so a
ten-minute mixed workload runs in seconds and gives the same answer every time.

Workload (issue #3): Poisson chat arrivals with prompts of 200-2,000 tokens and
answers of 100-300; beside it a batch job of 8,000-token documents that keeps
``batch_concurrency`` documents submitted at all times (a closed loop, as a batch
runner does), so the engine is saturated.

Those documents exceed every budget, so the single-request rule admits one at a
time whatever the budget loop does (issue #11). :data:`SMALL_DOCS` is the workload
where the rules bind: 500-2,000-token documents, several of which fit in a budget,
so the budget, its cuts and the interactive hold each change the figures;
:func:`rule_arms` runs it with each rule switched off beside the real scheduler.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from loadtests.sim.drivers import ProxyFront, Recorder, RequestRecord, engine_priority
from loadtests.sim.profile import StepCost
from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.step_loop import SimEngine
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.virtual import VirtualRunner
from loadtests.support.markdown import markdown_table
from proxy.clock import VirtualClock
from proxy.config import BudgetConfig, EngineConfig
from proxy.scheduler import HoldRules, Job, Scheduler, SchedulerSettings, TrafficClass
from proxy.scheduler.budget import percentile

__all__ = [
    "SMALL_DOCS",
    "ArmResult",
    "MixedWorkload",
    "evaluation_arms",
    "evaluation_table",
    "recommended_engine_flags",
    "rule_arms",
    "run_direct",
    "run_proxy",
    "verdict",
]


@dataclass(frozen=True, kw_only=True)
class MixedWorkload:
    duration_s: float = 600.0
    warmup_s: float = 30.0
    chat_rate_per_s: float = 2.0
    chat_prompt_tokens: tuple[int, int] = (200, 2000)
    chat_answer_tokens: tuple[int, int] = (100, 300)
    batch_doc_tokens: tuple[int, int] = (8000, 8000)
    batch_answer_tokens: int = 200
    batch_concurrency: int = 32
    seed: int = 0


SMALL_DOCS = MixedWorkload(chat_rate_per_s=6.0, batch_doc_tokens=(500, 2000), batch_concurrency=128)
"""Batch documents smaller than the budget, several at once in prefill, beside
chat busy enough that two chats often arrive within one prefill."""


@dataclass(frozen=True)
class ArmResult:
    name: str
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    gap_p95: float
    chat_done_p50: float
    chat_done_p95: float
    chats: int
    batch_docs_per_hour: float


def _summarise(records: dict[str, RequestRecord], name: str, workload: MixedWorkload) -> ArmResult:
    """The arm's figures over the measured window (after warm-up, before the end)."""
    lo, hi = workload.warmup_s, workload.duration_s
    chats = [
        r
        for r in records.values()
        if r.cls is TrafficClass.INTERACTIVE and lo <= r.arrival < hi and r.finished
    ]
    ttft = [r.first_token - r.arrival for r in chats if r.first_token is not None]
    done = [r.finished - r.arrival for r in chats if r.finished is not None]
    gaps = [g for r in chats for g in r.gaps]
    docs = [
        r
        for r in records.values()
        if r.cls is TrafficClass.BATCH and r.finished is not None and lo <= r.finished < hi
    ]
    return ArmResult(
        name=name,
        ttft_p50=percentile(ttft, 0.50),
        ttft_p95=percentile(ttft, 0.95),
        ttft_p99=percentile(ttft, 0.99),
        gap_p95=percentile(gaps, 0.95),
        chat_done_p50=percentile(done, 0.50),
        chat_done_p95=percentile(done, 0.95),
        chats=len(chats),
        batch_docs_per_hour=len(docs) / (hi - lo) * 3600,
    )


Submit = Callable[[float, str, TrafficClass, list[int], int], None]


def _drive(workload: MixedWorkload, runner: VirtualRunner, rec: Recorder, submit: Submit) -> None:
    """Schedule the chat arrivals and the batch job's closed loop."""
    rng = random.Random(workload.seed)
    doc_rng = random.Random(workload.seed + 1)  # sizes apart: the chat stream stays the same
    ids = iter(range(10**9))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(16, 32000) for _ in range(n)]

    def send(t: float, cls: TrafficClass, prompt: int, answer: int) -> None:
        rid = f"{cls.value}-{next(ids)}"
        rec.records[rid] = RequestRecord(cls, t)
        submit(t, rid, cls, tokens(prompt), answer)

    def next_doc(t: float) -> None:
        if t < workload.duration_s:
            size = doc_rng.randint(*workload.batch_doc_tokens)
            send(t, TrafficClass.BATCH, size, workload.batch_answer_tokens)

    def on_finished(record: RequestRecord, t: float) -> None:
        if record.cls is TrafficClass.BATCH:
            next_doc(t)

    rec.on_finished = on_finished
    for _ in range(workload.batch_concurrency):
        runner.call_at(0.0, next_doc)
    t = 0.0
    while True:
        t += rng.expovariate(workload.chat_rate_per_s)
        if t >= workload.duration_s:
            break
        prompt = rng.randint(*workload.chat_prompt_tokens)
        answer = rng.randint(*workload.chat_answer_tokens)
        runner.call_at(t, _bind(send, TrafficClass.INTERACTIVE, prompt, answer))


def _bind(
    send: Callable[[float, TrafficClass, int, int], None], cls: TrafficClass, p: int, a: int
) -> Callable[[float], None]:
    return lambda at: send(at, cls, p, a)


def run_direct(
    name: str, workload: MixedWorkload, config: SchedulerConfig, cost: StepCost
) -> ArmResult:
    """Every request straight into one engine; under the priority policy chat gets
    priority -10 and batch 0 (lower first, as in vLLM)."""
    clock = VirtualClock()
    engine = SimEngine(config, cost, clock)
    runner = VirtualRunner(engine, clock)
    rec = Recorder()
    runner.listeners.append(rec.listen)

    def submit(t: float, rid: str, cls: TrafficClass, prompt: list[int], answer: int) -> None:
        priority = engine_priority(config, cls)
        engine.add_request(prompt, answer, request_id=rid, priority=priority, arrival_time=t)

    _drive(workload, runner, rec, submit)
    runner.run()
    return _summarise(rec.records, name, workload)


def run_proxy(
    name: str,
    workload: MixedWorkload,
    config: SchedulerConfig,
    cost: StepCost,
    engine_settings: EngineConfig,
    scrape_interval_s: float = 1.0,
    scheduler_settings: SchedulerSettings | None = None,
) -> tuple[ArmResult, Scheduler]:
    """The same workload through the proxy's scheduler in front of one engine
    (requests enter the engine with priority 0 under either policy); the engine's
    load is scraped until the workload ends."""
    clock = VirtualClock()
    runner = VirtualRunner(SimEngine(config, cost, clock), clock)
    rec = Recorder()
    runner.listeners.append(rec.listen)  # timings first, then the scheduler's feedback
    front = ProxyFront(
        runner,
        engine_settings,
        scrape_interval_s=scrape_interval_s,
        keep_scraping=lambda t: t < workload.duration_s,
        scheduler_settings=scheduler_settings,
    )
    model = next(iter(engine_settings.models))

    def submit(t: float, rid: str, cls: TrafficClass, prompt: list[int], answer: int) -> None:
        job = Job(id=rid, cls=cls, model=model, prompt_tokens=len(prompt), arrival=t)
        front.submit(job, prompt, answer)

    _drive(workload, runner, rec, submit)
    runner.run()
    return _summarise(rec.records, name, workload), front.scheduler


def recommended_engine_flags(config: SchedulerConfig) -> SchedulerConfig:
    """The engine flags the proxy's documentation recommends beside it: cap each
    request's prefill chunk per step (``--long-prefill-token-threshold 2048``), so a
    long prompt in prefill never fills a whole step and a chat prompt admitted
    beside it starts at once."""
    return dataclasses.replace(config, long_prefill_token_threshold=2048)


def evaluation_arms(
    workload: MixedWorkload,
    config: SchedulerConfig,
    cost: StepCost,
    model: str,
    hold: HoldRules | None = None,
) -> list[ArmResult]:
    """The comparison of issue #3: direct FCFS, direct priority, through the proxy
    (and, to show flags alone do not do it, direct FCFS with the recommended flags).
    ``hold``: the proxy's hold rules (default :class:`HoldRules`)."""
    tuned = recommended_engine_flags(config)
    fcfs = dataclasses.replace(config, scheduling_policy=SchedulingPolicy.FCFS)
    prio = dataclasses.replace(config, scheduling_policy=SchedulingPolicy.PRIORITY)
    proxy_engine = EngineConfig(name="engine-0", models=frozenset({model}))
    extra = SchedulerSettings(hold=hold) if hold is not None else None
    proxied, _ = run_proxy(
        "(c) through the proxy, recommended flags",
        workload, tuned, cost, proxy_engine, scheduler_settings=extra,
    )  # fmt: skip
    return [
        run_direct("(a) direct, FCFS", workload, fcfs, cost),
        run_direct(
            "(a') direct, FCFS, recommended flags", workload, recommended_engine_flags(fcfs), cost
        ),
        run_direct("(b) direct, engine priority (chat -10)", workload, prio, cost),
        proxied,
    ]


def fixed_budget(tokens: int) -> BudgetConfig:
    """A budget the loop cannot move: ``tokens`` is its floor, start and ceiling."""
    return BudgetConfig(min_tokens=tokens, initial_tokens=tokens, max_tokens=tokens)


def rule_arms(
    workload: MixedWorkload, config: SchedulerConfig, cost: StepCost, model: str
) -> list[tuple[ArmResult, Scheduler]]:
    """The proxy arm with each of its rules switched off in turn, beside the real
    scheduler (all on the recommended engine flags): the budget loop off (AIMD
    never moves the initial budget), the interactive hold off, and the budget
    ignored (no prompt ever held for it)."""
    tuned = recommended_engine_flags(config)
    base = EngineConfig(name="engine-0", models=frozenset({model}))
    initial = base.budget.initial_tokens
    variants: list[tuple[str, EngineConfig, SchedulerSettings | None]] = [
        ("proxy, every rule on", base, None),
        ("proxy, AIMD off (budget fixed)", replace(base, budget=fixed_budget(initial)), None),
        (
            "proxy, interactive hold off",
            base,
            SchedulerSettings(hold=HoldRules(interactive_hold=False)),
        ),
        ("proxy, budget ignored", replace(base, budget=fixed_budget(10**9)), None),
    ]
    return [
        run_proxy(name, workload, tuned, cost, engine, scheduler_settings=extra)
        for name, engine, extra in variants
    ]


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def evaluation_table(results: list[ArmResult]) -> str:
    header = ["arm", "TTFT p50", "TTFT p95", "TTFT p99", "gap p95", "chat done p50"]
    header += ["chat done p95", "batch docs/hour"]
    return markdown_table(
        header,
        (
            [
                r.name,
                *(_fmt(s) for s in (r.ttft_p50, r.ttft_p95, r.ttft_p99, r.gap_p95)),
                _fmt(r.chat_done_p50),
                _fmt(r.chat_done_p95),
                f"{r.batch_docs_per_hour:,.0f}",
            ]
            for r in results
        ),
    )


def verdict(results: list[ArmResult], ttft_target_s: float) -> list[str]:
    """The bar of issue #3, checked: (c) p95 TTFT at or under target and at least
    5x lower than (a), with batch throughput at least 85% of (a)'s."""
    direct, proxied = results[0], results[-1]
    ratio = direct.ttft_p95 / proxied.ttft_p95
    share = proxied.batch_docs_per_hour / direct.batch_docs_per_hour

    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    return [
        f"- (c) TTFT p95 {_fmt(proxied.ttft_p95)} vs target {_fmt(ttft_target_s)}: "
        f"{mark(proxied.ttft_p95 <= ttft_target_s)}",
        f"- (c) TTFT p95 is {ratio:,.1f}x lower than (a): {mark(ratio >= 5)} (bar 5x)",
        f"- (c) batch throughput is {share:.1%} of (a): {mark(share >= 0.85)} (bar 85%)",
    ]
