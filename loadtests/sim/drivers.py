"""Pieces shared by the drivers that run simulated engines in virtual time (the twin's
mixed workload, scripted replays): per-request timings taken from step results, the
priority a client gives each traffic class, and the proxy's scheduler wired in front
of one simulated engine with no HTTP in between.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.step_loop import SimEngine, StepResult
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.virtual import VirtualRunner
from proxy.config import EngineConfig
from proxy.scheduler import Dispatch, EngineLoad, Job, Scheduler, SchedulerSettings, TrafficClass

INTERACTIVE_PRIORITY = TrafficClass.INTERACTIVE.engine_priority
BATCH_PRIORITY = TrafficClass.BATCH.engine_priority


def engine_priority(
    config: SchedulerConfig,
    cls: TrafficClass,
    *,
    interactive: int = INTERACTIVE_PRIORITY,
    batch: int = BATCH_PRIORITY,
) -> int:
    """The ``priority`` a request of ``cls`` carries into an engine with ``config``:
    by class under the priority policy (lower first, as in vLLM), 0 under FCFS
    (vLLM refuses any other value there)."""
    if config.scheduling_policy is SchedulingPolicy.FCFS:
        return 0
    return interactive if cls is TrafficClass.INTERACTIVE else batch


@dataclass
class RequestRecord:
    """One request's times in model seconds; None until the event happens."""

    cls: TrafficClass
    arrival: float
    first_token: float | None = None
    finished: float | None = None
    gaps: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)


class Recorder:
    """Per-request timings keyed by request id, fed from engine step results.

    Only requests with a record in :attr:`records` are followed; ``on_finished`` is
    called with a request's record and time as its last token arrives.
    """

    def __init__(self) -> None:
        self.records: dict[str, RequestRecord] = {}
        self.on_finished: Callable[[RequestRecord, float], None] = lambda record, t: None

    def listen(self, _: SimEngine, result: StepResult) -> None:
        for token in result.tokens:
            record = self.records.get(token.request.request_id)
            if record is None:
                continue
            record.token_times.append(token.time)
            if token.is_first:
                record.first_token = token.time
            elif token.gap is not None:
                record.gaps.append(token.gap)
            if token.finished:
                record.finished = token.time
                self.on_finished(record, token.time)


class ProxyFront:
    """The proxy's :class:`Scheduler` in front of the runner's first engine.

    :meth:`submit` queues a job in the scheduler; a job enters the engine the moment
    the scheduler dispatches it, with the priority ``priorities`` gives its class (0
    when None). Building a front registers, as the runner's next listener, the
    feedback of every step (first token, interactive gaps, finish, then another
    dispatch round), and a scrape of the engine's load at time 0 and then every
    ``scrape_interval_s`` while ``keep_scraping(t)`` says so after a scrape at ``t``.
    """

    def __init__(
        self,
        runner: VirtualRunner,
        settings: EngineConfig,
        *,
        scrape_interval_s: float,
        keep_scraping: Callable[[float], bool],
        priorities: Mapping[TrafficClass, int] | None = None,
        scheduler_settings: SchedulerSettings | None = None,
    ) -> None:
        if scrape_interval_s <= 0:
            raise ValueError(f"scrape_interval_s must be positive, got {scrape_interval_s}")
        self.runner = runner
        self.engine = runner.engine
        self.settings = settings
        self.scheduler = Scheduler([settings], runner.clock, scheduler_settings)
        self.scrape_interval_s = scrape_interval_s
        self.keep_scraping = keep_scraping
        self.priorities = dict(priorities or {})
        self._payloads: dict[str, tuple[list[int], int]] = {}
        # called with each dispatch as its job enters the engine
        self.on_dispatch: list[Callable[[Dispatch], None]] = []
        runner.listeners.append(self.feed)
        runner.call_at(0.0, self.scrape)

    def submit(self, job: Job, prompt: list[int], max_tokens: int) -> None:
        self._payloads[job.id] = (prompt, max_tokens)
        self.scheduler.submit(job)
        self.pump()

    def pump(self) -> None:
        """Send whatever the scheduler dispatches now into the engine."""
        for d in self.scheduler.dispatch():
            prompt, max_tokens = self._payloads.pop(d.job.id)
            priority = self.priorities.get(d.job.cls, 0)
            self.engine.add_request(prompt, max_tokens, request_id=d.job.id, priority=priority)
            for listener in self.on_dispatch:
                listener(d)

    def feed(self, _: SimEngine, result: StepResult) -> None:
        for token in result.tokens:
            rid = token.request.request_id
            if token.is_first:
                self.scheduler.on_first_token(rid)
            elif token.gap is not None:
                self.scheduler.on_token_gap(rid, token.gap)
            if token.finished:
                self.scheduler.on_finished(rid)
        self.pump()

    def scrape(self, t: float) -> None:
        engine = self.engine
        load = EngineLoad(engine.kv_cache_usage, engine.num_waiting, engine.num_running)
        self.scheduler.observe_load(self.settings.name, load)
        self.pump()
        if self.keep_scraping(t):
            self.runner.call_at(t + self.scrape_interval_s, self.scrape)
