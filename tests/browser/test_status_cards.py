"""The status page's cards panel, in a real headless Chromium, from the real
:func:`~proxy.api.turn.turn_body` of a card keeper (:class:`proxy.cards.CardKeeper`)
over a scheduler: model ``a`` awake, ``b`` asleep, a chat waiting for ``b`` (the
keeper's last decision: swap). The panel names the card, the awake model and the
decision's reason, and a row per model with its state; the sleeping engine's card
says it is asleep on its card, and the verdict does not count it as a fault. With no
card configured the panel stays hidden. A screenshot is kept as
``artifacts/status-cards.png``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page
from prometheus_client import CollectorRegistry

from proxy.admission import Admission
from proxy.cards import CardKeeper
from proxy.clock import VirtualClock
from proxy.config import Activation, CardConfig, EngineConfig, Settings
from proxy.engines import Activator, EngineMonitor, EnginePool
from proxy.metrics import CardMetrics
from proxy.scheduler import Job, Scheduler, TrafficClass

from .test_status_page import open_status_page, proxy_reads
from .test_status_verdict import reads

pytestmark = [pytest.mark.browser, pytest.mark.timeout(60)]

CARD = CardConfig(name="gpu0", memory_gib=80)


def on_card(name: str, model: str) -> EngineConfig:
    return EngineConfig(
        name=name,
        url=f"http://127.0.0.1:9{len(name)}",
        models=(model,),
        card="gpu0",
        footprint_gib=60,
        activation=Activation(sleep_level=1),
    )


def keeper_reads() -> Callable[[str], Any]:
    clock = VirtualClock()
    engines = [on_card("engine-a", "a"), on_card("engine-b", "b")]
    scheduler = Scheduler(engines, clock)
    admission = Admission(scheduler)
    pool = EnginePool(engines, httpx.AsyncClient())  # never called: no swap is run
    monitor = EngineMonitor(pool, admission, Settings(engines=tuple(engines), cards=(CARD,)))
    sleep = Activation(sleep_level=1)
    activators = {e.name: Activator(pool.client_for(e.name), sleep) for e in engines}
    metrics = CardMetrics(CollectorRegistry())
    keeper = CardKeeper(CARD, engines, activators, admission, monitor, clock, metrics)
    keeper.awake.add("a")
    keeper.card.awake = "a"
    scheduler.set_engine_resting("engine-b", "asleep")
    clock.advance(90.0)
    chat = Job(id="chat-1", cls=TrafficClass.INTERACTIVE, model="b", prompt_tokens=40,
               arrival=clock.now())  # fmt: skip
    scheduler.submit(chat)
    decision = keeper.step()
    assert decision is not None and decision.target == "b"  # the swap the page shows

    return reads(scheduler, cards=[keeper])


def test_the_cards_panel_shows_the_awake_model_and_why(page: Page, artifacts: Path) -> None:
    strays = open_status_page(page, keeper_reads())
    page.wait_for_selector('#cards:not([hidden]) [data-card="gpu0"]')
    line = page.locator('[data-card="gpu0"] .card-line').inner_text()
    assert line == "gpu0 (80 GiB): a awake for 90.0 s — chat waiting for b"
    rows = page.locator('[data-card="gpu0"] tbody tr').evaluate_all(
        "trs => trs.map(tr => [...tr.children].map(td => td.textContent))"
    )
    assert rows == [["a", "engine-a", "awake", "30.0 s"], ["b", "engine-b", "asleep", "30.0 s"]]
    page.wait_for_selector('[data-engine="engine-b"][data-state="asleep"]')
    badge = page.locator('[data-engine="engine-b"] .state').inner_text()
    assert badge == "asleep: on its card; woken when its model's turn comes"
    verdict = page.locator("#verdict").get_attribute("data-level")
    assert verdict != "bad" and "engine-b" not in page.locator("#verdict-line").inner_text()
    page.screenshot(path=str(artifacts / "status-cards.png"), full_page=True)
    assert strays == []


def test_the_cards_panel_stays_hidden_without_a_card(page: Page) -> None:
    engine = EngineConfig(name="e0", models=frozenset({"m"}))
    strays = open_status_page(page, proxy_reads(Scheduler([engine], VirtualClock())))
    page.wait_for_selector('[data-engine="e0"]')
    assert page.locator("#cards").is_hidden() and page.locator("[data-card]").count() == 0
    assert strays == []
