"""``GET /status`` in a real headless Chromium.

- Against a real simulated engine and the real proxy (child processes, output in
  ``artifacts/browser/*.log``): with only batch work running the page says
  ``batch``; within a second of chat requests being sent it says ``interactive``;
  afterwards ``batch`` again. A screenshot is kept as ``artifacts/status-page.png``.
- Against the real :func:`~proxy.api.turn.turn_body` of a scripted scheduler with
  four engines, served through Playwright's request interception: every engine
  gets its card with its turn (a dead engine: ``down``) and held reason, and the page says
  ``reconnecting`` while ``/turn`` is unreachable and recovers after.
- A page opened after a minute of batch turns draws that minute at once, from the
  proxy's own history (``/turn/history``), and says the share of the last 10 s; a
  budget at its floor says which signal cut it.
- The batch section, from the real :func:`~proxy.batch.view.job_row` of three
  jobs: one on time, one whose window is out of reach, one still validating.
- The prefix cache, against a real simulated engine that reports its cached tokens
  and the real proxy: two batch prompts that open with one document, and the card
  shows the index the proxy kept from what it routed and the hit rate its
  ``/metrics`` counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from playwright.sync_api import Page, Route
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.admission import Admission
from proxy.api.status import install_status_route
from proxy.api.turn import history_body, log_body, turn_body
from proxy.batch.runner import BatchRunner, Complete, RunnerLimits
from proxy.batch.store import BatchRecord, BatchStore
from proxy.batch.view import job_row
from proxy.clock import VirtualClock
from proxy.config import BudgetConfig, EngineConfig
from proxy.metrics import BatchMetrics, ProxyMetrics
from proxy.scheduler import Job, Scheduler, TrafficClass
from tests.support import MODEL
from tests.support.children import logged_proxy, logged_sim
from tests.support.processes import LOOPBACK

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]

# cpu-tiny at half real time: ~0.4 ms per prompt token and ~12 ms per decode step.
# Two ~2,400-token chat prompts keep chat in prefill for about two seconds (many
# polls of the page), the batch answers (4,000 tokens each) outlast the test, and
# the proxy relays few enough tokens that a busy 2-core machine keeps up.
TIME_SCALE = 0.5
BATCH_REQUESTS = 3
BATCH_WORDS = 300
BATCH_MAX_TOKENS = 4000
CHAT_REQUESTS = 2
HELD_BATCH_REQUESTS = 2
CHAT_WORDS = 2400
SWITCH_WITHIN_S = 1.0

PROXY_OPTIONS: dict[str, Any] = {
    "scrape_interval_s": 0.1,
    "health_interval_s": 0.5,
    "connect_timeout_s": 1.0,
}

# -- servers: real child processes on loopback ports -------------------------------


@dataclass(frozen=True)
class Stack:
    """A simulated engine and the proxy in front of it."""

    sim_url: str
    proxy_url: str
    engine: str


@contextmanager
def run_stack(
    tmp: Path, logs: Path, sim_flags: Sequence[str], proxy_options: dict[str, Any]
) -> Iterator[Stack]:
    """``whoseturn sim --profile cpu-tiny SIM_FLAGS``, then ``whoseturn serve`` in
    front of it (engine ``engine-0``); yields once both are ready."""
    with logged_sim(logs, *sim_flags, grace_s=5) as (_, sim_url):
        engine = {"url": sim_url, "name": "engine-0", "models": [MODEL]}
        with logged_proxy(tmp, [engine], logs=logs, grace_s=5, host=LOOPBACK, **proxy_options) as (
            _,
            proxy_url,
        ):
            yield Stack(sim_url=sim_url, proxy_url=proxy_url, engine="engine-0")


# -- the scenario ---------------------------------------------------------------

WORDS = "river stone amber cloud maple harbor lantern meadow copper violet".split()


def text(tag: str, n: int) -> str:
    """``n`` words, led by ``tag`` so that no two prompts share a cached prefix."""
    return " ".join([tag, *(WORDS[i % len(WORDS)] for i in range(n))])


def turn_of(page: Page, engine: str) -> str | None:
    value: str | None = page.eval_on_selector(
        f'[data-engine="{engine}"] .turn', "el => el.dataset.turn"
    )
    return value


def wait_turn(page: Page, engine: str, turn: str, timeout_s: float) -> None:
    page.wait_for_function(
        '([engine, turn]) => document.querySelector(`[data-engine="${engine}"] .turn`)'
        "?.dataset.turn === turn",
        arg=[engine, turn],
        timeout=timeout_s * 1000,
    )


class Traffic:
    """Streaming requests to the proxy, each in its own thread with its own client.

    A request may wait for ``gate`` after its connection is open, so that a group
    of them is sent at one known moment. Errors are collected, never raised in the
    threads; :meth:`close` hangs up the streams still open.
    """

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    def start(self, path: str, body: dict[str, Any], gate: threading.Event | None = None) -> None:
        thread = threading.Thread(target=self._run, args=(path, body, gate), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _run(self, path: str, body: dict[str, Any], gate: threading.Event | None) -> None:
        timeout = httpx.Timeout(60, connect=5)
        try:
            with httpx.Client(base_url=self.base_url, timeout=timeout) as client:
                client.get("/healthz").raise_for_status()  # open the connection now
                if gate is not None:
                    gate.wait(30)
                with client.stream("POST", path, json={**body, "stream": True}) as response:
                    if response.status_code != 200:
                        response.read()
                        self.errors.append(f"{path}: {response.status_code} {response.text}")
                        return
                    for _ in response.iter_lines():
                        if self.stop.is_set():
                            return
        except httpx.HTTPError as exc:
            if not self.stop.is_set():
                self.errors.append(f"{path}: {exc!r}")

    def join(self, threads: list[threading.Thread], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.stop.set()
        self.join(self.threads, 5)


@pytest.fixture
def stack(tmp_path: Path, artifacts: Path) -> Iterator[Stack]:
    with run_stack(
        tmp_path, artifacts / "browser", ["--time-scale", str(TIME_SCALE)], PROXY_OPTIONS
    ) as s:
        yield s


def proxy_turn(stack: Stack) -> dict[str, Any]:
    engines: list[dict[str, Any]] = httpx.get(f"{stack.proxy_url}/turn", timeout=5).json()[
        "engines"
    ]
    return engines[0]


class TurnWatch(threading.Thread):
    """Poll the proxy's ``/turn`` until its first engine is on ``turn``; ``seconds``
    is how long after ``since`` that was seen (for the report of a slow switch)."""

    def __init__(self, stack: Stack, turn: str, since: float) -> None:
        super().__init__(daemon=True)
        self.stack, self.turn, self.since = stack, turn, since
        self.seconds = float("nan")

    def run(self) -> None:
        with httpx.Client(base_url=self.stack.proxy_url, timeout=5) as client:
            while time.monotonic() - self.since < 5:
                if client.get("/turn").json()["engines"][0]["turn"] == self.turn:
                    self.seconds = time.monotonic() - self.since
                    return
                time.sleep(0.05)


def watch_turn(stack: Stack, turn: str, since: float) -> TurnWatch:
    watch = TurnWatch(stack, turn, since)
    watch.start()
    return watch


def test_status_page_switches_from_batch_to_interactive(
    page: Page, stack: Stack, artifacts: Path
) -> None:
    engine = stack.engine
    page.goto(f"{stack.proxy_url}/status")
    wait_turn(page, engine, "idle", 5)
    assert page.get_attribute("#connection", "data-state") == "live"

    traffic = Traffic(stack.proxy_url)
    try:
        for i in range(BATCH_REQUESTS):
            batch = {"model": MODEL, "prompt": text(f"batch{i}", BATCH_WORDS)}
            traffic.start("/batch/v1/completions", {**batch, "max_tokens": BATCH_MAX_TOKENS})
        wait_turn(page, engine, "batch", 5)
        # Only batch work, all of it past prefill and decoding: still batch's turn.
        deadline = time.monotonic() + 10
        while proxy_turn(stack)["decode_streams"]["batch"] < BATCH_REQUESTS:
            assert time.monotonic() < deadline, f"batch never all decoding: {proxy_turn(stack)}"
            time.sleep(0.05)
        time.sleep(0.5)
        assert turn_of(page, engine) == "batch"
        assert not traffic.errors, traffic.errors

        gate = threading.Event()
        chats = len(traffic.threads)
        for i in range(CHAT_REQUESTS):
            content = text(f"chat{i}", CHAT_WORDS)
            chat = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
            traffic.start("/v1/chat/completions", {**chat, "max_tokens": 8}, gate)
        time.sleep(0.3)  # every chat thread has its connection open and waits
        sent = time.monotonic()
        gate.set()
        proxy_switch = watch_turn(stack, "interactive", sent)
        wait_turn(page, engine, "interactive", 5)
        switched_s = time.monotonic() - sent
        proxy_switch.join(5)
        timing = (
            f"status page showed interactive {switched_s * 1000:.0f} ms after the chats were "
            f"sent; /turn said so after {proxy_switch.seconds * 1000:.0f} ms"
        )
        print(timing)
        assert switched_s < SWITCH_WITHIN_S, timing
        assert page.get_attribute(f'[data-engine="{engine}"]', "data-turn") == "interactive"

        # Batch arriving now waits in the proxy while chat is in prefill.
        for i in range(HELD_BATCH_REQUESTS):
            batch = {"model": MODEL, "prompt": text(f"late{i}", BATCH_WORDS)}
            traffic.start("/batch/v1/completions", {**batch, "max_tokens": BATCH_MAX_TOKENS})
        page.wait_for_selector(
            f'[data-engine="{engine}"] .held[data-reason="interactive_waiting"]', timeout=1500
        )
        page.screenshot(path=str(artifacts / "status-page.png"), full_page=True)

        chat_threads = traffic.threads[chats : chats + CHAT_REQUESTS]
        traffic.join(chat_threads, 20)
        assert not any(t.is_alive() for t in chat_threads), "chats never finished"
        wait_turn(page, engine, "batch", 5)
        assert not traffic.errors, traffic.errors
    except BaseException:
        page.screenshot(path=str(artifacts / "status-page-failed.png"), full_page=True)
        raise
    finally:
        traffic.close()


# -- any number of engines, and an unreachable proxy ------------------------------


def scripted_scheduler() -> tuple[Scheduler, VirtualClock]:
    """Four engines, one model each: ``a`` interactive (batch held while chat waits),
    ``b`` batch (held by the prefill budget), ``c`` down, ``d`` idle."""
    clock = VirtualClock(1000.0)
    budget = BudgetConfig(initial_tokens=4096, min_tokens=512, max_tokens=65536)
    engines = [
        EngineConfig(name=f"engine-{n}", models=frozenset({n}), budget=budget) for n in "abcd"
    ]
    scheduler = Scheduler(engines, clock)
    ids = iter(range(1000))

    def submit(model: str, cls: TrafficClass, tokens: int) -> str:
        job_id = f"{cls.value}-{next(ids)}"
        scheduler.submit(
            Job(id=job_id, cls=cls, model=model, prompt_tokens=tokens, arrival=clock.now())
        )
        return job_id

    decoding = submit("a", TrafficClass.BATCH, 3000)
    for _ in range(3):
        submit("b", TrafficClass.BATCH, 3000)
    scheduler.dispatch()
    clock.advance(0.5)
    scheduler.on_first_token(decoding)
    for _ in range(8):  # chat answers on engine-a, for TTFT samples
        chat = submit("a", TrafficClass.INTERACTIVE, 400)
        scheduler.dispatch()
        clock.advance(0.12)
        scheduler.on_first_token(chat)
        scheduler.on_token_gap(chat, 0.03)
        scheduler.on_finished(chat)
    submit("a", TrafficClass.INTERACTIVE, 1500)
    submit("a", TrafficClass.BATCH, 3000)
    submit("c", TrafficClass.BATCH, 100)
    scheduler.set_engine_up("engine-c", False)
    scheduler.dispatch()
    clock.advance(0.2)
    return scheduler, clock


ORIGIN = "http://whoseturn.test"


def open_status_page(
    page: Page, reads: Callable[[str], Any], offline: threading.Event | None = None
) -> list[str]:
    """Open the real status page at :data:`ORIGIN`, each of its reads (a path with its
    query) answered with the JSON ``reads(path)`` gives (Prometheus text where that is
    a string), refused where that is ``None``; while ``offline`` is set, every read
    but the page itself is refused. Returns the list of the refused paths and of
    requests to other origins, which stays empty while the page reads only what it
    should (it is self-contained)."""
    app = FastAPI()
    install_status_route(app)
    status = TestClient(app).get("/status")
    strays: list[str] = []

    def handle(route: Route) -> None:
        path = route.request.url.removeprefix(ORIGIN)
        if path == route.request.url:
            strays.append(path)  # the page is self-contained: nothing from elsewhere
            route.abort("blockedbyclient")
        elif path == "/status":
            route.fulfill(status=200, headers=dict(status.headers), body=status.content)
        elif offline is not None and offline.is_set():
            route.abort("connectionrefused")
        elif isinstance(body := reads(path), str):
            route.fulfill(body=body, content_type=CONTENT_TYPE_LATEST)
        elif body is not None:
            route.fulfill(json=body)
        else:
            strays.append(path)
            route.abort("blockedbyclient")

    page.route("**/*", handle)
    page.goto(f"{ORIGIN}/status")
    return strays


def proxy_reads(scheduler: Scheduler) -> Callable[[str], Any]:
    """The proxy's answers to the page's reads, from ``scheduler`` (no batch jobs;
    ``/metrics`` from the proxy's registry on it, no answer served)."""
    admission = Admission(scheduler)
    metrics = ProxyMetrics(scheduler, 0.3)

    def read(path: str) -> Any:
        if path == "/metrics":
            return generate_latest(metrics.registry).decode()
        if path == "/status/batches":
            return {"enabled": False, "jobs": []}
        if path.startswith("/turn/log"):
            return log_body(admission, 14)
        if path.startswith("/turn/history"):
            return history_body(admission, 60)
        if path.startswith("/turn"):
            return turn_body(admission)
        return None

    return read


def test_status_page_shows_every_engine_and_reconnects(page: Page) -> None:
    scheduler, clock = scripted_scheduler()
    offline = threading.Event()
    strays = open_status_page(page, proxy_reads(scheduler), offline)
    expected = {
        "engine-a": ("interactive", "interactive_waiting"),
        "engine-b": ("batch", "prefill_budget"),
        "engine-c": ("down", "engine_unhealthy"),  # the scheduler's turn: saturated
        "engine-d": ("idle", ""),
    }
    for name, (turn, _) in expected.items():
        wait_turn(page, name, turn, 5)
    cards = page.eval_on_selector_all(
        "[data-engine]",
        "els => els.map(el => [el.dataset.engine, el.querySelector('.turn').dataset.turn,"
        " el.querySelector('.held').dataset.reason])",
    )
    assert {c[0]: (c[1], c[2]) for c in cards} == expected
    assert "by the prefill budget" in page.inner_text('[data-engine="engine-b"] .held')
    assert page.inner_text('[data-engine="engine-c"] .state') == "down: its health checks fail"
    index = page.locator('[data-engine="engine-a"] .prefix-index')
    assert (index.get_attribute("data-mode"), index.get_attribute("data-blocks")) == ("routed", "0")
    page.wait_for_function(  # a function, not an expression: the page's CSP forbids eval
        "sel => document.querySelector(sel).textContent.startsWith('hit rate:')",
        arg='[data-engine="engine-a"] .prefix-hits',
    )
    hits = page.locator('[data-engine="engine-a"] .prefix-hits')
    assert hits.inner_text() == "hit rate: no answer has reported its cached tokens yet"
    assert hits.get_attribute("data-rate") == ""
    page.wait_for_selector("#log tbody tr")

    offline.set()
    page.wait_for_selector('#connection[data-state="reconnecting"]', timeout=3000)
    assert page.inner_text("#connection") == "reconnecting…"
    assert page.locator("[data-engine]").count() == 4  # the last state stays in view

    job = next(j for j in scheduler.jobs.values() if j.cls is TrafficClass.INTERACTIVE)
    clock.advance(0.3)
    scheduler.on_first_token(job.id)  # engine-a's chat is answered meanwhile
    offline.clear()
    page.wait_for_selector('#connection[data-state="live"]', timeout=5000)
    wait_turn(page, "engine-a", "batch", 3)
    assert not strays, strays


def test_a_page_opened_now_shows_the_last_minute_at_once(page: Page) -> None:
    clock = VirtualClock(1000.0)
    engine = EngineConfig(name="engine-a", models=frozenset({"a"}))
    scheduler = Scheduler([engine], clock)
    scheduler.submit(
        Job(id="doc", cls=TrafficClass.BATCH, model="a", prompt_tokens=100, arrival=1000.0)
    )
    scheduler.dispatch()
    for _ in range(70):  # seventy seconds of batch's turn, before the page exists
        clock.advance(1.0)
        scheduler.tick()
    open_status_page(page, proxy_reads(scheduler))
    wait_turn(page, "engine-a", "batch", 5)
    page.wait_for_function(
        "document.querySelector('[data-engine=\"engine-a\"] .timeline').width > 0"
    )
    page.wait_for_function(
        "document.querySelector('[data-engine=\"engine-a\"] .recent').textContent !== ''"
    )
    assert page.inner_text('[data-engine="engine-a"] .recent') == "batch 100% of the last 10 s"
    # the timeline is batch's colour from its left edge to now, on the first draw
    colours = page.eval_on_selector(
        '[data-engine="engine-a"] .timeline',
        """c => [0.02, 0.5, 0.98].map(f => {
            const d = c.getContext('2d').getImageData(Math.floor(c.width * f), 5, 1, 1).data;
            return [d[0], d[1], d[2]];
        })""",
    )
    batch = page.evaluate(
        "getComputedStyle(document.documentElement).getPropertyValue('--batch').trim()"
    )
    expected = [int(batch[i : i + 2], 16) for i in (1, 3, 5)]
    # within a few levels: seconds meet at fractional pixels, blended at the seams
    near = all(abs(c - e) <= 8 for colour in colours for c, e in zip(colour, expected, strict=True))
    assert near, (colours, batch)


def test_a_budget_at_its_floor_says_why_on_the_page(page: Page, artifacts: Path) -> None:
    """A minute of chat beside batch, its first tokens slow: the budget is cut to
    its floor, and the page says which signal cut it and ties the red TTFT to it."""
    clock = VirtualClock(1000.0)
    engine = EngineConfig(name="engine-a", models=frozenset({"a"}), batch_max_inflight=8)
    scheduler = Scheduler([engine], clock)
    ids = iter(range(10**6))

    def job(cls: TrafficClass, tokens: int) -> str:
        job_id = f"{cls.value}-{next(ids)}"
        scheduler.submit(
            Job(id=job_id, cls=cls, model="a", prompt_tokens=tokens, arrival=clock.now())
        )
        scheduler.dispatch()
        return job_id

    job(TrafficClass.BATCH, 300)
    for _ in range(20):  # a minute: a second of slow chats beside batch, then two of batch
        chats = [job(TrafficClass.INTERACTIVE, 400) for _ in range(20)]
        clock.advance(1.0)
        for chat in chats:
            scheduler.on_first_token(chat)
            scheduler.on_finished(chat)
        for _ in range(2):
            clock.advance(1.0)
            scheduler.tick()
    job(TrafficClass.BATCH, 300)
    job(TrafficClass.INTERACTIVE, 400)  # a chat now: interactive's turn
    clock.advance(0.3)
    budget = scheduler.engines["engine-a"].budget
    assert budget.tokens == budget.settings.min_tokens
    open_status_page(page, proxy_reads(scheduler))
    wait_turn(page, "engine-a", "interactive", 5)
    why = page.locator('[data-engine="engine-a"] .budget-why')
    why.wait_for()
    page.wait_for_function(
        "document.querySelector('[data-engine=\"engine-a\"] .budget-why').textContent !== ''"
    )
    assert why.get_attribute("data-state") == "floor"
    assert why.inner_text().startswith(
        "Budget 512 tokens, at its floor: cut for the time to first token (p95 1.00 s over"
        " its aim 240 ms, target 300 ms, 20 samples"
    )
    ttft = page.inner_text('[data-engine="engine-a"] .ttft-caption')
    assert "over target" in ttft and "budget cut to 512 for it" in ttft
    page.wait_for_timeout(1200)  # the timeline's history poll
    page.screenshot(path=str(artifacts / "status-budget-floor.png"), full_page=True)


# -- the batch section ----------------------------------------------------------------


def batch_rows() -> list[dict[str, Any]]:
    """Three active jobs at t=1000, rows made by the real code: ``batch_fast`` did a
    record a second for 100 s (100 left: done at 1100, window to 5000);
    ``batch_slow`` 8 records in its first 10 s (10,000 left at 0.8/s: 13,500, window
    to 2000); ``batch_new`` is still validating (nothing known)."""
    runner = BatchRunner(
        cast(BatchStore, None), cast(Complete, None), cast(BatchMetrics, None),
        RunnerLimits(), lambda: 1000.0,
    )  # fmt: skip
    runner.throughput.begin("batch_fast", "m", 900.0)
    for i in range(100):
        runner.throughput.add(900.0 + i, "batch_fast", "m", usable=True)
    runner.throughput.begin("batch_slow", "n", 990.0)
    for i in range(8):
        runner.throughput.add(990.0 + i, "batch_slow", "n", usable=i < 4)

    def job(batch_id: str, status: str, total: int, done: int, expires_at: int) -> BatchRecord:
        return BatchRecord(
            batch_id, "/v1/chat/completions", "file-x", "24h", status, 900, expires_at,
            None, total, done, 0,
        )  # fmt: skip

    jobs = [
        job("batch_fast", "in_progress", 200, 100, 5000),
        job("batch_slow", "in_progress", 10_008, 8, 2000),
        job("batch_new", "validating", 0, 0, 5000),
    ]
    return [job_row(runner, b) for b in jobs]


def test_status_page_shows_batch_jobs_and_a_window_out_of_reach(page: Page) -> None:
    rows = batch_rows()

    def read(path: str) -> Any:
        if path == "/status/batches":
            return {"enabled": True, "jobs": rows}
        if path.startswith("/turn/log"):
            return {"budget": [], "decisions": []}
        if path.startswith("/turn"):
            return {"time": 1000.0, "engines": []}
        return None

    open_status_page(page, read)
    page.wait_for_selector('#batch-jobs tr[data-batch="batch_new"]', timeout=5000)
    assert page.is_visible("#batches") and not page.is_visible("#batches-empty")
    reach = page.eval_on_selector_all(
        "#batch-jobs tbody tr", "els => els.map(el => [el.dataset.batch, "
        "el.querySelector('.eta').dataset.reachable, el.children[2].textContent, "
        "el.children[3].textContent])",
    )  # fmt: skip
    assert reach == [
        ["batch_fast", "true", "100 / 200 (50%)", "3,600"],
        ["batch_slow", "false", "8 / 10,008 (0%)", "2,880"],
        ["batch_new", "unknown", "reading the file", "—"],
    ]
    assert "after the window" in page.inner_text('tr[data-batch="batch_slow"] .eta')
    assert "after the window" not in page.inner_text('tr[data-batch="batch_fast"] .eta')


# -- the prefix cache ---------------------------------------------------------------


def prefix_counts(exposition: str, engine: str) -> dict[str, float]:
    """``engine``'s prefix-cache counters in the proxy's ``/metrics`` text: its prompt
    tokens and the cached tokens reported and expected."""
    counts = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.labels.get("engine") != engine:
                continue
            if sample.name == "whoseturn_prefix_prompt_tokens_total":
                counts["prompt"] = sample.value
            elif sample.name == "whoseturn_prefix_cached_tokens_total":
                counts[sample.labels["source"]] = sample.value
    return counts


def test_status_page_shows_the_prefix_index_and_hit_rate(
    page: Page, tmp_path: Path, artifacts: Path
) -> None:
    flags = ["--time-scale", "20", "--enable-prompt-tokens-details"]
    with run_stack(tmp_path, artifacts / "browser", flags, PROXY_OPTIONS) as stack:
        document = text("doc", 600)
        with httpx.Client(base_url=stack.proxy_url, timeout=30) as http:
            for i in range(2):  # one after the other: the second finds the first's document
                body = {"model": MODEL, "prompt": f"{document} question{i}", "max_tokens": 4}
                answer = http.post("/batch/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
            counts = prefix_counts(http.get("/metrics").text, stack.engine)
            index = http.get("/turn").json()["engines"][0]["prefix_index"]
        prompt, reported, expected = counts["prompt"], counts["reported"], counts["expected"]
        assert 0 < reported < prompt and 0 < expected < prompt, counts
        assert index["mode"] == "routed" and index["blocks"] > 0, index

        page.goto(f"{stack.proxy_url}/status")
        card = f'[data-engine="{stack.engine}"]'
        page.wait_for_function(  # a function, not an expression: the page's CSP forbids eval
            "sel => document.querySelector(sel)?.dataset.rate > ''",
            arg=f"{card} .prefix-hits",
            timeout=5000,
        )
        hits = page.locator(f"{card} .prefix-hits")
        assert float(hits.get_attribute("data-rate") or "nan") == reported / prompt
        shown = hits.inner_text()
        start = f"hit rate since start: {100 * reported / prompt:.1f}% of {prompt:,.0f} prompt"
        assert shown.startswith(start), (shown, counts)
        assert f"the index expected {100 * expected / prompt:.1f}%" in shown, (shown, counts)
        shown_index = page.locator(f"{card} .prefix-index")
        assert shown_index.get_attribute("data-mode") == "routed"
        assert shown_index.get_attribute("data-blocks") == str(index["blocks"])
        assert f"{index['blocks']:,} blocks of {index['block_size']} tokens" in (
            shown_index.inner_text()
        )
        page.screenshot(path=str(artifacts / "status-prefix.png"), full_page=True)
