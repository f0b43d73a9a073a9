"""Properties of the model over random workloads, checked at every step.

Small budgets, sequence caps and KV caches make chunking, admission limits and
preemption common; both policies, chunked prefill on and off, prefix caching on and
off, async scheduling on and off. Each step is planned and applied by hand against a
virtual clock. Under async scheduling a step is planned while the one before it is
in flight, so the checks of a plan against the queues just before it are left out
there; the limits, the KV accounting and every request's tokens are checked all the
same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from loadtests.sim import SimEngine, VirtualClock
from loadtests.sim.profile import StepCost
from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.request import RequestStatus, SimRequest
from loadtests.sim.step_scheduler import SchedulerConfig, SchedulerOutput

from .helpers import check_kv_accounting

COST = StepCost(
    fixed_s=0.01,
    prefill_per_token_s=0.001,
    decode_per_token_s=0.002,
    prefill_attention_per_token_context_s=1e-6,
    decode_per_context_token_s=1e-5,
    decode_step_overhead_s=0.001,
)
MAX_STEPS = 3_000


@dataclass(frozen=True)
class Spec:
    arrival: float
    prompt_len: int
    max_tokens: int
    priority: int
    family: int  # requests of one family share a prefix; -1: a prompt of its own


@dataclass(frozen=True)
class Abort:
    step: int
    target: int
    mid_step: bool  # between planning the step and applying it


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 64))
    chunked = draw(st.booleans())
    if chunked:
        budget = draw(st.integers(1, 48))
        threshold = draw(st.sampled_from([0, 0, 1, 3, 8]))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 32))
        threshold = 0
    min_blocks = math.ceil(max_model_len / block_size)
    return SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 6)),
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
        scheduling_policy=draw(st.sampled_from(SchedulingPolicy)),
        block_size=block_size,
        num_gpu_blocks=draw(st.integers(min_blocks, 3 * min_blocks)),
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
    )


def workloads(config: SchedulerConfig) -> st.SearchStrategy[list[Spec]]:
    spec = st.builds(
        Spec,
        arrival=st.integers(0, 20).map(lambda n: n * 0.02),
        prompt_len=st.integers(1, config.max_model_len - 1),
        max_tokens=st.integers(1, 24),
        priority=st.integers(-2, 2),
        family=st.integers(-1, 2),
    )
    return st.lists(spec, min_size=1, max_size=12)


def prompt_of(spec: Spec, index: int) -> list[int]:
    if spec.family < 0:
        return [10_000 * (index + 1) + i for i in range(spec.prompt_len)]
    return [100 * (spec.family + 1) + i for i in range(spec.prompt_len)]


@dataclass
class Run:
    """A workload stepped by hand, with every step's plan checked."""

    config: SchedulerConfig
    specs: list[Spec]
    aborts: list[Abort] = field(default_factory=list)
    clock: VirtualClock = field(default_factory=VirtualClock)

    def __post_init__(self) -> None:
        self.engine = SimEngine(self.config, COST, self.clock)
        self.sched = self.engine.scheduler
        self.requests: dict[int, SimRequest] = {}
        self.aborted_outputs: dict[str, int] = {}
        self.first_admissions: list[str] = []
        self.last_end = self.clock.now()

    def pending(self) -> list[int]:
        """Requests not yet arrived, by arrival time."""
        waiting = [i for i in range(len(self.specs)) if i not in self.requests]
        return sorted(waiting, key=lambda i: (self.specs[i].arrival, i))

    def arrive(self) -> None:
        for i in self.pending():
            spec = self.specs[i]
            if spec.arrival <= self.clock.now():
                self.requests[i] = self.engine.add_request(
                    prompt_of(spec, i),
                    spec.max_tokens,
                    priority=spec.priority,
                    request_id=f"r{i}",
                    arrival_time=spec.arrival,
                )

    def abort(self, step: int, mid_step: bool) -> None:
        for a in self.aborts:
            request = self.requests.get(a.target)
            if a.step != step or a.mid_step != mid_step or request is None:
                continue
            if request.is_finished:
                continue
            assert self.engine.abort_request(request.request_id) is request
            assert request.status is RequestStatus.ABORTED
            assert self.sched.kv.blocks_of(request.request_id) == []
            assert request not in self.sched.running
            assert request not in list(self.sched.waiting)
            check_kv_accounting(self.sched)
            self.aborted_outputs[request.request_id] = len(request.output_token_ids)

    def go(self) -> None:
        for step in range(MAX_STEPS):
            self.arrive()
            self.abort(step, mid_step=False)
            before = Before(self)
            plan = self.engine.begin_step()
            if plan is None:
                assert not self.sched.has_unfinished_requests, "stalled with work left"
                pending = self.pending()
                if not pending:
                    return
                self.clock.advance_to(self.specs[pending[0]].arrival)
                continue
            assert plan.start == self.clock.now() >= self.last_end
            self.check_plan(plan.output, before)
            self.abort(step, mid_step=True)
            self.clock.advance(plan.duration)
            self.last_end = plan.end
            result = self.engine.finish_step(plan)
            for token in result.tokens:
                assert token.time == plan.end == self.clock.now()
                assert token.request.request_id not in self.aborted_outputs
        raise AssertionError(f"not done after {MAX_STEPS} steps")

    def check_plan(self, out: SchedulerOutput, before: Before) -> None:
        config, sched = self.config, self.sched
        ids = [c.request_id for c in out.chunks]
        assert len(set(ids)) == len(ids)
        assert out.num_tokens <= config.max_num_batched_tokens
        assert len(out.chunks) <= config.max_num_seqs
        assert len(sched.running) <= config.max_num_seqs
        ahead = config.async_scheduling
        for chunk in out.chunks:
            request = sched.requests.get(chunk.request_id)
            if request is None or request.num_preemptions != chunk.num_preemptions:
                # aborted or preempted while the step is in flight: it is not applied
                assert ahead
                continue
            assert chunk.num_tokens >= 1
            # planned ahead, a step may decode the token the step in flight samples
            limit = request.num_tokens + (1 if ahead else 0)
            assert chunk.num_computed_before + chunk.num_tokens <= limit
            assert len(sched.kv.blocks_of(request.request_id)) * config.block_size >= (
                chunk.num_computed_before + chunk.num_tokens
            )
            if not chunk.is_decode and config.long_prefill_token_threshold:
                assert chunk.num_tokens <= config.long_prefill_token_threshold
            if not chunk.is_decode and not config.enable_chunked_prefill:
                assert chunk.num_computed_before + chunk.num_tokens == request.num_tokens
        check_kv_accounting(sched)
        if ahead:
            self.first_admissions.extend(out.newly_scheduled)
            return
        self.check_order(out, before)
        for rid in out.preempted:
            request = sched.requests[rid]
            assert request.num_preemptions >= 1
            if rid in ids:  # readmitted when planning went on after an empty pass
                assert request.status is RequestStatus.RUNNING
                continue
            assert request.status is RequestStatus.PREEMPTED
            assert request.num_computed_tokens == 0
        check_kv_accounting(sched)

    def check_order(self, out: SchedulerOutput, before: Before) -> None:
        """Running requests first; admissions follow the queue's policy."""
        ids = [c.request_id for c in out.chunks]
        kept = [rid for rid in before.running if rid not in out.preempted]
        served = [rid for rid in ids if rid in kept]
        admitted = [rid for rid in ids if rid not in kept]
        assert ids == served + admitted
        unserved = [rid for rid in kept if rid not in ids]
        if admitted:
            assert unserved == []
        if unserved and not out.preempted:
            assert out.num_tokens == self.config.max_num_batched_tokens
        # Preempted requests go back to the queue (FCFS: to its front) before admission.
        victims = [self.sched.requests[rid] for rid in reversed(out.preempted)]
        queue = victims + before.waiting
        if self.config.scheduling_policy is SchedulingPolicy.FCFS:
            assert not (admitted and out.preempted)
            assert admitted == [r.request_id for r in queue[: len(admitted)]]
        else:
            keys = {r.request_id: (r.priority, r.arrival_time) for r in queue}
            assert [keys[rid] for rid in admitted] == sorted(keys.values())[: len(admitted)]
        self.first_admissions.extend(out.newly_scheduled)

    def check_end(self) -> None:
        event(f"preemptions: {'some' if self.sched.num_preemptions else 'none'}")
        hits = any(r.num_cached_tokens > 0 for r in self.requests.values())
        event(f"prefix cache hits: {'some' if hits else 'none'}")
        event(f"aborts: {len(self.aborted_outputs)}")
        assert not self.sched.has_unfinished_requests
        assert self.sched.running == [] and len(self.sched.waiting) == 0
        assert self.sched.kv.num_free_blocks == self.config.num_gpu_blocks
        tokenizer = self.engine.tokenizer
        for i, request in self.requests.items():
            spec = self.specs[i]
            if request.request_id in self.aborted_outputs:
                assert request.status is RequestStatus.ABORTED
                assert len(request.output_token_ids) == self.aborted_outputs[request.request_id]
                continue
            expected = min(spec.max_tokens, self.config.max_model_len - spec.prompt_len)
            assert request.status is RequestStatus.FINISHED
            assert request.finish_reason == "length"
            # Each position sampled once, in order, whatever preemption recomputed.
            assert request.output_token_ids == [
                tokenizer.sample(request.seed, n) for n in range(expected)
            ]
            assert request.first_scheduled_time is not None
            assert request.first_token_time is not None
            assert request.finished_time is not None
            assert request.arrival_time <= request.first_scheduled_time
            assert request.first_scheduled_time < request.first_token_time
            assert request.first_token_time <= request.finished_time <= self.clock.now()
            assert request.num_cached_tokens % self.config.block_size == 0
            assert 0 <= request.num_cached_tokens < spec.prompt_len
            if not self.config.enable_prefix_caching:
                assert request.num_cached_tokens == 0
        if self.config.scheduling_policy is SchedulingPolicy.FCFS:
            order = {f"r{i}": (s.arrival, i) for i, s in enumerate(self.specs)}
            assert self.first_admissions == sorted(self.first_admissions, key=order.__getitem__)


class Before:
    """The scheduler's queues just before a step is planned."""

    def __init__(self, run: Run) -> None:
        self.running = [r.request_id for r in run.sched.running]
        self.waiting = list(run.sched.waiting)


@st.composite
def scenarios(draw: st.DrawFn, with_aborts: bool = False) -> Run:
    config = draw(configs())
    specs = draw(workloads(config))
    aborts: list[Abort] = []
    if with_aborts:
        abort = st.builds(
            Abort,
            step=st.integers(0, 30),
            target=st.integers(0, len(specs) - 1),
            mid_step=st.booleans(),
        )
        aborts = draw(st.lists(abort, max_size=4))
    return Run(config, specs, aborts)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_every_step_respects_the_limits_and_every_request_finishes(run: Run) -> None:
    run.go()
    run.check_end()


# Planned ahead, r11's in-flight step reaches max_model_len, so it is not planned
# again, and the request that preempts itself for want of blocks cannot be
# readmitted beside it: an empty plan, which once sent planning round forever.
AHEAD_EMPTY = Run(
    SchedulerConfig(
        max_num_batched_tokens=14,
        max_num_seqs=6,
        max_model_len=20,
        block_size=8,
        num_gpu_blocks=4,
        async_scheduling=True,
    ),
    [
        Spec(0.3, 19, 20, 2, 2),
        Spec(0.22, 8, 21, -1, 1),
        Spec(0.02, 9, 8, 1, 2),
        Spec(0.0, 8, 3, 1, -1),
        Spec(0.34, 13, 5, -2, 2),
        Spec(0.3, 14, 2, -1, 2),
        Spec(0.4, 10, 10, -2, 0),
        Spec(0.06, 16, 15, -2, 0),
        Spec(0.08, 5, 22, 1, 1),
        Spec(0.06, 16, 24, 0, 0),
        Spec(0.2, 13, 20, 2, 2),
        Spec(0.26, 19, 15, 2, -1),
    ],
    [Abort(28, 6, True), Abort(8, 5, True), Abort(18, 5, False), Abort(13, 2, True)],
)


@settings(max_examples=50, deadline=None)
@given(scenarios(with_aborts=True))
@example(AHEAD_EMPTY)
def test_aborts_free_at_once_and_are_never_resurrected(run: Run) -> None:
    run.go()
    run.check_end()
