"""Tenants' fair share, in virtual time: the proxy's scheduler in front of a simulated
engine (loadtests.sim.tenants), and the fair queue's rules on their own.

Shares are read over a window in the middle of a run where every tenant named was
backlogged (each keeps more requests outstanding than the engine or the budget
lets through); each test checks that the backlog happened before it compares.
"""

from __future__ import annotations

from collections import defaultdict

from loadtests.sim.tenants import NOISY, QUIET, TenantLoad, run_tenants
from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.scheduler import (
    Dispatch,
    HeldReason,
    Job,
    Scheduler,
    SchedulerSettings,
    Tier,
    TrafficClass,
)
from proxy.scheduler.budget import percentile
from proxy.scheduler.fair import OUTPUT_WEIGHT

CHAT, BATCH = TrafficClass.INTERACTIVE, TrafficClass.BATCH
CAPPED = EngineConfig(name="engine-0", models=frozenset({"llama-3-8b"}), max_inflight=8)


def _shares(counts: dict[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


def _assert_within(shares: dict[str, float], owed: dict[str, float], margin: float) -> None:
    for tenant, want in owed.items():
        got = shares.get(tenant, 0.0)
        assert abs(got - want) <= margin * want, (tenant, got, want, shares)


def test_three_tenants_1_1_2_share_the_interactive_first_token_slots() -> None:
    loads = [
        TenantLoad(name="a", outstanding=24, prompt_tokens=(400, 600), answer_tokens=32),
        TenantLoad(name="b", outstanding=24, prompt_tokens=(400, 600), answer_tokens=32),
        TenantLoad(name="c", weight=2, outstanding=24, prompt_tokens=(400, 600), answer_tokens=32),
    ]
    records, scheduler = run_tenants(loads, 40.0, engine=CAPPED)
    window = [r for r in records if r.first_token is not None and 10 <= r.first_token < 40]
    slots: dict[str, float] = defaultdict(float)
    for r in window:
        slots[r.tenant] += r.prompt + OUTPUT_WEIGHT * r.answer
    # the evidence: every tenant waited in the proxy's queue (the cap was the limit)
    waited = {d.tenant for d in scheduler.log if not d.admitted}
    assert waited == {"a", "b", "c"}, "not every tenant was backlogged: no fairness shown"
    _assert_within(_shares(slots), {"a": 0.25, "b": 0.25, "c": 0.5}, 0.10)
    counts: dict[str, float] = defaultdict(float)
    for r in window:
        counts[r.tenant] += 1
    _assert_within(_shares(counts), {"a": 0.25, "b": 0.25, "c": 0.5}, 0.10)
    fairness = scheduler.fairness(CHAT)
    assert fairness is not None and fairness > 0.95


def test_in_arrival_order_the_same_tenants_get_what_they_ask_not_their_weights() -> None:
    """The control: with fair share off, c's weight buys it nothing."""
    loads = [
        TenantLoad(name="a", outstanding=24, prompt_tokens=(400, 600), answer_tokens=32),
        TenantLoad(name="c", weight=2, outstanding=24, prompt_tokens=(400, 600), answer_tokens=32),
    ]
    records, _ = run_tenants(
        loads, 40.0, engine=CAPPED, settings=SchedulerSettings(fair_share=False)
    )
    counts: dict[str, float] = defaultdict(float)
    for r in records:
        if r.first_token is not None and 10 <= r.first_token < 40:
            counts[r.tenant] += 1
    assert abs(_shares(counts)["c"] - 0.5) < 0.05


def _batch(name: str, **kw: object) -> TenantLoad:
    return TenantLoad(name=name, cls=BATCH, outstanding=64, answer_tokens=16, **kw)  # type: ignore[arg-type]


def _batch_loads(stop_c: float = float("inf")) -> list[TenantLoad]:
    return [
        _batch("a", prompt_tokens=(1000, 3000)),
        _batch("b", prompt_tokens=(1000, 3000)),
        TenantLoad(
            name="c", cls=BATCH, weight=2, outstanding=64, prompt_tokens=(1000, 3000),
            answer_tokens=16, stop_s=stop_c,
        ),
    ]  # fmt: skip


def test_three_tenants_1_1_2_share_the_batch_budget() -> None:
    admitted: dict[str, float] = defaultdict(float)

    def seen(d: Dispatch) -> None:
        if 10 <= d.at < 40:
            admitted[d.job.tenant] += d.job.prompt_tokens

    _, scheduler = run_tenants(_batch_loads(), 40.0, on_dispatch=seen)
    held = [d for d in scheduler.log if not d.admitted and d.reason is HeldReason.PREFILL_BUDGET]
    assert {d.tenant for d in held} == {"a", "b", "c"}, "the budget never held every tenant"
    _assert_within(_shares(admitted), {"a": 0.25, "b": 0.25, "c": 0.5}, 0.10)


def test_a_tenant_that_goes_idle_gives_its_share_to_the_others_at_once() -> None:
    admitted: dict[tuple[str, str], float] = defaultdict(float)

    def seen(d: Dispatch) -> None:
        span = "before" if 10 <= d.at < 30 else "after" if 31 <= d.at < 40 else ""
        if span:
            admitted[span, d.job.tenant] += d.job.prompt_tokens

    run_tenants(_batch_loads(stop_c=30.0), 40.0, on_dispatch=seen)
    before = {t: admitted["before", t] for t in "abc"}
    after = {t: admitted["after", t] for t in "ab"}
    _assert_within(_shares(before), {"a": 0.25, "b": 0.25, "c": 0.5}, 0.10)
    _assert_within(_shares(after), {"a": 0.5, "b": 0.5}, 0.10)
    # work-conserving: c's part went to a and b, not to idle
    rate_before = sum(before.values()) / 20
    rate_after = sum(after.values()) / 9
    assert rate_after >= 0.85 * rate_before, (rate_before, rate_after)


def test_the_service_gap_between_two_backlogged_tenants_stays_under_the_bound() -> None:
    """Start-time fair queuing's bound: |W_a/w_a - W_b/w_b| <= c_a/w_a + c_b/w_b
    (the largest job's cost of each over its weight), W the cost dispatched."""
    loads = [
        _batch("a", prompt_tokens=(100, 4000)),
        TenantLoad(
            name="b", cls=BATCH, weight=3, outstanding=64, prompt_tokens=(100, 4000),
            answer_tokens=16,
        ),
    ]  # fmt: skip
    weights = {"a": 1.0, "b": 3.0}
    served = {"a": 0.0, "b": 0.0}
    largest = {"a": 0.0, "b": 0.0}
    gaps: list[float] = []

    def seen(d: Dispatch) -> None:
        # from 1 s (both have queued their 64) to 40 s (they stop): both backlogged
        if not 1.0 <= d.at < 40:
            return
        cost = d.job.prompt_tokens + OUTPUT_WEIGHT * d.job.expected_output
        served[d.job.tenant] += cost
        largest[d.job.tenant] = max(largest[d.job.tenant], cost)
        gaps.append(abs(served["a"] / weights["a"] - served["b"] / weights["b"]))

    run_tenants(loads, 40.0, on_dispatch=seen)
    bound = largest["a"] / weights["a"] + largest["b"] / weights["b"]
    assert len(gaps) > 200
    assert max(gaps) <= bound, (max(gaps), bound)
    assert served["b"] / served["a"] > 2.5  # and b did get about three times a's


def test_a_noisy_tenant_moves_a_quiet_tenants_ttft_far_less_than_in_arrival_order() -> None:
    """The quiet tenant's TTFT p95 alone, beside the noisy one in arrival order, and
    beside it with fair share. The floor is the noisy prompt's prefill step the quiet
    chat lands behind (docs/tenants.md); arrival order puts it behind 32 of them."""

    def quiet_p95(loads: list[TenantLoad], fair: bool) -> tuple[float, float]:
        records, _ = run_tenants(loads, 40.0, settings=SchedulerSettings(fair_share=fair))
        ttft = [
            r.first_token - r.arrival
            for r in records
            if r.tenant == "quiet" and r.arrival >= 5 and r.first_token is not None
        ]
        noisy = sum(r.answer for r in records if r.tenant == "noisy" and r.finished)
        assert len(ttft) > 50
        return percentile(ttft, 0.95), noisy

    alone, _ = quiet_p95([QUIET], True)
    arrival, noisy_arrival = quiet_p95([QUIET, NOISY], False)
    fair, noisy_fair = quiet_p95([QUIET, NOISY], True)
    assert arrival > 10 * alone  # the noisy tenant hurts: the evidence
    assert fair < arrival / 1.8, (alone, arrival, fair)
    assert noisy_fair >= 0.8 * noisy_arrival  # and fairness costs the noisy tenant little


def _job(i: int, tenant: str, tokens: int = 100, **kw: object) -> Job:
    return Job(
        id=f"{tenant}-{i}", cls=BATCH, model="m", prompt_tokens=tokens, arrival=0.0,
        tenant=tenant, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _scheduler(**settings: object) -> Scheduler:
    engine = EngineConfig(name="e", models=frozenset({"m"}), max_inflight=1)
    return Scheduler([engine], VirtualClock(), SchedulerSettings(**settings))  # type: ignore[arg-type]


def test_the_queue_interleaves_tenants_by_weight_and_keeps_each_in_arrival_order() -> None:
    s = _scheduler()
    for i in range(6):
        s.submit(_job(i, "a"))
    for i in range(6):
        s.submit(_job(i, "b", weight=2.0))
    order = [j.id for j in s.queues[BATCH]]
    assert order[:6].count("b-0") + order[:6].count("b-1") == 2
    assert [j for j in order if j.startswith("a")] == [f"a-{i}" for i in range(6)]
    assert [j for j in order if j.startswith("b")] == [f"b-{i}" for i in range(6)]
    # b (weight 2) gets two places for each of a's, once both are queued
    assert sum(1 for j in order[:9] if j.startswith("b")) == 6


def test_fair_share_off_keeps_arrival_order() -> None:
    s = _scheduler(fair_share=False)
    for i in range(3):
        s.submit(_job(i, "a"))
    s.submit(_job(0, "b", tier=Tier.CRITICAL))
    assert [j.id for j in s.queues[BATCH]] == ["a-0", "a-1", "a-2", "b-0"]


def test_a_critical_tier_goes_before_standard_and_sheddable() -> None:
    s = _scheduler()
    s.submit(_job(0, "low", tier=Tier.SHEDDABLE))
    s.submit(_job(0, "std"))
    s.submit(_job(0, "top", tier=Tier.CRITICAL))
    assert [j.id for j in s.queues[BATCH]] == ["top-0", "std-0", "low-0"]
    assert [j.engine_priority for j in s.queues[BATCH]] == [-1, 0, 1]


def test_an_idle_flow_banks_no_credit() -> None:
    """A tenant that was away comes back at the class's virtual time: it goes next,
    but does not take every place until it has caught up."""
    s = _scheduler()
    for i in range(20):
        s.submit(_job(i, "a"))
    for _ in range(10):  # ten of a's are served
        (d,) = s.dispatch()
        s.on_finished(d.job.id, 0)
    for i in range(4):
        s.submit(_job(i, "late"))
    order = [j.id for j in s.queues[BATCH]]
    assert order[0] == "late-0"
    assert order[:8].count("late-0") + sum(1 for j in order[:8] if j.startswith("a")) >= 4


def test_the_finish_settles_the_charge_for_the_output_actually_made() -> None:
    """Two tenants asking the same: one's answers come out far longer than expected;
    its later jobs fall behind the other's."""
    s = _scheduler()
    for i in range(4):
        s.submit(_job(i, "long", expected_output=10))
        s.submit(_job(i, "short", expected_output=10))
    for _ in range(2):
        (d,) = s.dispatch()
        s.on_finished(d.job.id, 2000 if d.job.tenant == "long" else 10)
    for i in range(4, 8):
        s.submit(_job(i, "long", expected_output=10))
        s.submit(_job(i, "short", expected_output=10))
    later = [j.id for j in s.queues[BATCH] if j.id.endswith(("-4", "-5", "-6", "-7"))]
    assert later.index("short-7") < later.index("long-4")


def test_reads_do_not_change_the_fair_state() -> None:
    s = _scheduler()
    for i in range(3):
        s.submit(_job(i, "a"))
        s.submit(_job(i, "b"))
    s.dispatch()
    before = ([j.id for j in s.queues[BATCH]], s.fair[BATCH].vtime)
    shares = s.tenant_shares()
    s.fairness(BATCH)
    assert ([j.id for j in s.queues[BATCH]], s.fair[BATCH].vtime) == before
    assert {x.tenant for x in shares} == {"a", "b"}
    assert {x.queued + x.in_flight for x in shares} == {3}
