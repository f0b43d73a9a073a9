"""The status page read in five seconds, in a real headless Chromium, from the real
:func:`~proxy.api.turn.turn_body` and :func:`~proxy.api.turn.log_body` of scripted
schedulers (served through Playwright's request interception, as in
``test_status_page.py``):

- one verdict at the top, its level and the numbers under it: a TTFT over its
  target and the budget cut for it; chat on target beside batch; no engine up;
- each engine's state named for what it is, the same word in every place the page
  names it: down (its health checks fail), ejected (outlier detection), draining,
  saturated (at its cap), idle; a dead engine never reads "saturated";
- the token gap's figure is the one the budget loop judges (53 ms, green, since
  its last cut), the window's p95 of every sample (318 ms, the burst it cut for)
  beside it and never coloured; a TTFT between the loop's aim and its target is
  amber, not red;
- the decisions list groups requests told alike (twelve batch requests held for
  the prefill budget, then admitted: one row of twelve), each with its request id
  as a link to its own anchor, and its tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from playwright.sync_api import Page

from proxy.admission import Admission
from proxy.api.turn import history_body, log_body, turn_body
from proxy.cards import CardKeeper
from proxy.clock import VirtualClock
from proxy.config import BudgetConfig, EngineConfig
from proxy.scheduler import Job, Scheduler, TrafficClass

from .test_status_page import open_status_page

pytestmark = [pytest.mark.browser, pytest.mark.timeout(60)]

CHAT, BATCH = TrafficClass.INTERACTIVE, TrafficClass.BATCH
LOG_LIMIT = 200  # what the page asks GET turn/log for


class Watch:
    """The engine monitor's view as ``/turn`` reads it (:class:`proxy.api.turn.EngineWatch`)."""

    def __init__(self, failures: Mapping[str, int], ejected_because: Mapping[str, str]) -> None:
        self.failures = failures
        self.ejected_because = ejected_because


def reads(
    scheduler: Scheduler, watch: Watch | None = None, cards: Sequence[CardKeeper] = ()
) -> Callable[[str], Any]:
    """The proxy's answers to the page's reads, from ``scheduler`` (and ``watch``, and
    the keepers of ``cards``)."""
    admission = Admission(scheduler)

    def read(path: str) -> Any:
        if path == "/metrics":
            return ""
        if path == "/status/batches":
            return {"enabled": False, "jobs": []}
        if path.startswith("/turn/log"):
            return log_body(admission, LOG_LIMIT, cards=cards)
        if path.startswith("/turn/history"):
            return history_body(admission, 60)
        if path.startswith("/turn"):
            return turn_body(admission, watch=watch, cards=cards)
        return None

    return read


class Script:
    """A scheduler on a virtual clock, and jobs sent to it by name."""

    def __init__(self, *engines: EngineConfig) -> None:
        self.clock = VirtualClock(1000.0)
        self.scheduler = Scheduler(list(engines), self.clock)
        self.n = 0

    def send(self, cls: TrafficClass, tokens: int, model: str = "m", tenant: str = "") -> str:
        self.n += 1
        job_id = f"{'chat' if cls is CHAT else 'batch'}-{self.n}"
        self.scheduler.submit(
            Job(id=job_id, cls=cls, model=model, prompt_tokens=tokens,
                arrival=self.clock.now(), tenant=tenant)
        )  # fmt: skip
        self.scheduler.dispatch()
        return job_id

    def chats(self, n: int, ttft_s: float, gap_s: float) -> None:
        """``n`` chats at once, each answered after ``ttft_s`` with one gap of ``gap_s``."""
        sent = [self.send(CHAT, 100) for _ in range(n)]
        self.clock.advance(ttft_s)
        for chat in sent:
            self.scheduler.on_first_token(chat)
            self.scheduler.on_token_gap(chat, gap_s)
            self.scheduler.on_finished(chat)

    def judge(self) -> None:
        """A second on: the budget loop runs."""
        self.clock.advance(1.0)
        self.scheduler.tick()


def engine(name: str, **kw: Any) -> EngineConfig:
    budget = BudgetConfig(initial_tokens=4096, min_tokens=512, max_tokens=65536)
    return EngineConfig(name=name, models=frozenset({"m"}), budget=budget, **kw)


def verdict(page: Page) -> tuple[str, str]:
    page.wait_for_function(
        "() => document.querySelector('#verdict')?.dataset.level !== 'none'", timeout=5000
    )
    level = page.get_attribute("#verdict", "data-level") or ""
    return level, page.inner_text("#verdict-line")


def states(page: Page) -> dict[str, list[str]]:
    """Per engine, every word the page names its state by: the card's data-state, the
    headline, the badge's data-state, and the verdict row's state cell."""
    found: dict[str, list[str]] = page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('[data-engine]')].map(c => [
            c.dataset.engine,
            [c.dataset.state, c.querySelector('.turn').textContent,
             c.querySelector('.state').dataset.state,
             document.querySelector(`[data-verdict-engine="${c.dataset.engine}"] .state-word`)
               .dataset.state],
        ]))"""
    )
    return found


# -- the verdict ----------------------------------------------------------------


def test_a_ttft_over_target_leads_the_page_with_the_cut(page: Page) -> None:
    s = Script(engine("e0", batch_max_inflight=8))
    s.send(BATCH, 300)  # in prefill for good: every chat shares e0 with batch
    s.chats(20, ttft_s=1.0, gap_s=0.02)
    s.judge()
    assert s.scheduler.engines["e0"].budget.changes[-1].cause == "ttft"
    open_status_page(page, reads(s.scheduler))
    level, line = verdict(page)
    assert (level, line.split(";")[0]) == ("bad", "Chat TTFT over target on e0: budget cut")
    ttft = page.locator('[data-verdict-engine="e0"] .ttft')
    assert ttft.get_attribute("data-level") == "over-target"
    assert float(ttft.get_attribute("data-value") or "nan") == pytest.approx(1.0)
    assert "target 300 ms" in ttft.inner_text()


def test_chat_on_target_beside_batch_reads_so(page: Page) -> None:
    s = Script(engine("e0", batch_max_inflight=8))
    s.send(BATCH, 300)
    s.chats(25, ttft_s=0.05, gap_s=0.02)  # well within the aims (240 ms, 80 ms)
    s.judge()
    open_status_page(page, reads(s.scheduler))
    assert verdict(page) == ("ok", "Chat on target; batch running within budget.")
    for which in ("ttft", "gap"):
        cell = page.locator(f'[data-verdict-engine="e0"] .{which}')
        assert cell.get_attribute("data-level") == "ok"


def test_no_engine_up_says_so_and_a_dead_engine_reads_down(page: Page) -> None:
    s = Script(engine("e0"), engine("e1"))
    s.send(BATCH, 300)
    s.send(CHAT, 100)
    for name in ("e0", "e1"):
        s.scheduler.set_engine_up(name, False)
    s.scheduler.dispatch()
    assert {e["turn"] for e in turn_body(Admission(s.scheduler))["engines"]} == {"saturated"}
    open_status_page(page, reads(s.scheduler))
    headline = page.locator('[data-engine="e0"] .turn')
    page.wait_for_function(
        "el => el.textContent !== ''", arg=headline.element_handle(timeout=5000), timeout=5000
    )
    assert headline.inner_text() == "down"  # the scheduler's turn says saturated
    level, line = verdict(page)
    assert level == "bad"
    assert line.startswith("No engine up (e0 down, e1 down)"), line
    assert states(page) == {"e0": ["down"] * 4, "e1": ["down"] * 4}
    assert "saturated" not in page.inner_text('[data-engine="e0"]')
    assert page.title().startswith("e0: down, e1: down")


# -- engine states ----------------------------------------------------------------


def test_each_engine_state_is_named_for_what_it_is(page: Page) -> None:
    """e0 ejected by outlier detection, e1 down by its health checks, e2 draining,
    e3 at its cap, e4 idle, e5 serving batch."""
    s = Script(*(engine(f"e{n}", max_inflight=1 if n == 3 else 256) for n in range(6)))
    for name in ("e0", "e1"):
        s.scheduler.set_engine_up(name, False)
    s.scheduler.drain_engine("e2")
    s.send(BATCH, 300)  # to an up engine with room: the first of e3, e4, e5 by load
    s.send(BATCH, 300)
    s.send(BATCH, 300)
    inflight = {n: len(e.inflight) for n, e in s.scheduler.engines.items()}
    assert inflight == {"e0": 0, "e1": 0, "e2": 0, "e3": 1, "e4": 1, "e5": 1}, inflight
    s.scheduler.on_first_token(next(iter(s.scheduler.engines["e4"].inflight)))
    s.scheduler.on_finished(next(iter(s.scheduler.engines["e4"].inflight)))
    watch = Watch(
        failures={"e0": 1, "e1": 3},
        ejected_because={"e0": "a stream timed out (no first byte in 30 s)",
                         "e1": "3 health checks failed in a row"},
    )  # fmt: skip
    open_status_page(page, reads(s.scheduler, watch))
    page.wait_for_selector('[data-engine="e5"][data-state="batch"]', timeout=5000)
    assert states(page) == {
        "e0": ["ejected"] * 4,
        "e1": ["down"] * 4,
        "e2": ["draining"] * 4,
        "e3": ["saturated"] * 4,
        "e4": ["idle"] * 4,
        "e5": ["batch"] * 4,
    }
    assert "a stream timed out" in page.inner_text('[data-engine="e0"] .state')
    assert "3 health checks failed in a row" in page.inner_text('[data-engine="e1"] .explain')
    _, line = verdict(page)
    assert "e0 ejected, e1 down, e2 draining, e3 saturated" in line, line


# -- colours from the loop's thresholds ------------------------------------------------


def test_the_gap_shown_is_the_one_the_loop_judges(page: Page) -> None:
    """A burst of 318 ms gaps cuts the budget; then 53 ms gaps: the loop judges 53 ms
    (samples since its cut), while every sample of its window has a p95 of 318 ms."""
    s = Script(engine("e0", batch_max_inflight=8))
    s.send(BATCH, 300)
    s.chats(20, ttft_s=0.02, gap_s=0.318)
    s.judge()
    assert s.scheduler.engines["e0"].budget.changes[-1].cause == "gap"
    s.chats(25, ttft_s=0.02, gap_s=0.053)
    s.judge()
    gap = turn_body(Admission(s.scheduler))["engines"][0]["interactive_gap"]
    assert (gap["p95_s"], gap["judged_s"]) == (pytest.approx(0.318), pytest.approx(0.053))
    open_status_page(page, reads(s.scheduler))
    caption = page.locator('[data-engine="e0"] .gap-caption')
    page.wait_for_function(
        "el => el.textContent !== ''", arg=caption.element_handle(timeout=5000), timeout=5000
    )
    assert caption.inner_text().startswith("53 ms · target 100 ms, aim 80 ms · within aim")
    assert caption.get_attribute("data-level") == "ok"
    assert float(caption.get_attribute("data-value") or "nan") == pytest.approx(0.053)
    window = page.locator('[data-engine="e0"] .gap-window')
    assert "p95 318 ms" in window.inner_text()
    good, muted, shown, window_colour = page.evaluate(
        """() => {
            const css = getComputedStyle(document.documentElement);
            const probe = (name) => {
                const el = document.createElement('span');
                el.style.color = css.getPropertyValue(name);
                document.body.appendChild(el);
                const c = getComputedStyle(el).color;
                el.remove();
                return c;
            };
            const card = document.querySelector('[data-engine="e0"]');
            return [probe('--good'), probe('--muted'),
                    getComputedStyle(card.querySelector('.gap-caption .fig')).color,
                    getComputedStyle(card.querySelector('.gap-window')).color];
        }"""
    )
    assert (shown, window_colour) == (good, muted)
    row = page.locator('[data-verdict-engine="e0"] .gap')
    assert row.get_attribute("data-level") == "ok"


def test_a_ttft_between_aim_and_target_is_amber_not_red(page: Page) -> None:
    """Slow first tokens (1 s) cut the budget; then 270 ms ones, over the loop's aim
    (240 ms) and within the target (300 ms), cut it again: the loop's figure is
    270 ms, amber, though every sample of its window has a p95 of 1 s."""
    s = Script(engine("e0", batch_max_inflight=8))
    s.send(BATCH, 300)
    s.chats(20, ttft_s=1.0, gap_s=0.02)
    s.judge()
    s.chats(20, ttft_s=0.27, gap_s=0.02)
    s.judge()
    cut = s.scheduler.engines["e0"].budget.changes[-1]
    assert cut.cause == "ttft" and cut.ttft_s == pytest.approx(0.27)
    open_status_page(page, reads(s.scheduler))
    caption = page.locator('[data-engine="e0"] .ttft-caption')
    page.wait_for_function(
        "el => el.textContent !== ''", arg=caption.element_handle(timeout=5000), timeout=5000
    )
    assert caption.inner_text().startswith("270 ms · target 300 ms, aim 240 ms · over aim")
    assert caption.get_attribute("data-level") == "over-aim"
    assert page.get_attribute('[data-verdict-engine="e0"] .ttft', "data-level") == "over-aim"
    level, line = verdict(page)
    assert level == "warn" and line.startswith("Chat on target, above the loop's aim on e0")


# -- the decisions, grouped ---------------------------------------------------------


def test_decisions_group_repeats_with_their_request_ids_and_tenant(page: Page) -> None:
    """Thirteen batch requests of team-a: the first admitted at once, twelve held for
    the prefill budget and admitted one by one as the one before left prefill; and a
    chat of team-b. Three rows, not twenty-six."""
    s = Script(engine("e0", batch_max_inflight=64))
    batch = [s.send(BATCH, 3000, tenant="team-a") for _ in range(13)]
    for job_id in batch:
        s.clock.advance(0.1)
        s.scheduler.on_first_token(job_id)
        s.scheduler.dispatch()
    chat = s.send(CHAT, 100, tenant="team-b")
    decisions = log_body(Admission(s.scheduler), LOG_LIMIT)["decisions"]
    assert len(decisions) == 26
    open_status_page(page, reads(s.scheduler))
    page.wait_for_selector("#log tbody tr", timeout=5000)
    assert page.locator("#log tbody tr").count() == 3  # not a row per decision
    rows = page.locator("#log tbody tr").evaluate_all(
        """trs => trs.map(tr => ({...tr.dataset,
            class: tr.querySelector('.d-class').textContent,
            tenant: tr.querySelector('.d-tenant').textContent,
            what: tr.querySelector('.d-what').textContent,
            ids: [...tr.querySelectorAll('.request-id')].map(a => a.dataset.requestId)}))"""
    )
    assert len(rows) == 3, rows
    held = next(r for r in rows if r["count"] == "12")
    assert held["what"] == "12 batch requests held for prefill budget, then admitted"
    assert (held["class"], held["holds"], held["outcome"]) == (
        "batch",
        "prefill_budget",
        "admitted",
    )
    assert held["tenant"] == "team-a"
    assert sorted(held["ids"]) == sorted(batch[1:])
    first = next(r for r in rows if r["ids"] == [batch[0]])
    assert (first["count"], first["what"]) == ("1", "1 batch request admitted")
    newest = rows[0]  # newest first: the chat
    assert (newest["ids"], newest["tenant"], newest["what"]) == (
        [chat],
        "team-b",
        "1 chat request admitted",
    )
    # each id is a link to its own anchor: the page can point at one request
    link = page.locator(f'.request-id[data-request-id="{batch[5]}"]')
    assert link.get_attribute("id") == f"request-{batch[5]}"
    assert link.get_attribute("href") == f"#request-{batch[5]}"
