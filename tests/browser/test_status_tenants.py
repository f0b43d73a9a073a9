"""The status page's tenants panel and the decisions' tenant column, in a real
headless Chromium, from the real :func:`~proxy.api.turn.turn_body` and
:func:`~proxy.api.turn.log_body` of a scripted scheduler (served through Playwright's
request interception, as in ``test_status_page.py``).

Two tenants of weights 1 and 3, served 30% and 70% of the chat tokens: the
interactive block says the fairness index in words and each tenant's share against
what it is owed, the larger share first; the batch block, with one tenant, says the
index is not judged. With no tenant active the panel stays hidden. A screenshot is
kept as ``artifacts/status-tenants.png``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import Page

from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.scheduler import Scheduler
from tests.unit.api.test_turn_tenants import jain, scripted

from .test_status_page import open_status_page, proxy_reads

pytestmark = [pytest.mark.browser, pytest.mark.timeout(60)]


def test_the_tenants_panel_shows_share_against_owed_and_the_verdict(
    page: Page, artifacts: Path
) -> None:
    strays = open_status_page(page, proxy_reads(scripted()))
    page.wait_for_selector('#tenants:not([hidden]) [data-tenant-class="interactive"]')
    chat = page.locator('[data-tenant-class="interactive"]')
    fairness = chat.locator(".fairness")
    assert fairness.get_attribute("data-verdict") == "nearly fair"
    index = float(fairness.get_attribute("data-index") or "nan")
    assert index == pytest.approx(jain([150 / 1, 350 / 3]))
    assert fairness.inner_text() == f"interactive: fairness {index:.2f}, nearly fair"
    rows = chat.locator("tbody tr").evaluate_all(
        "trs => trs.map(tr => [tr.dataset.tenant, Number(tr.dataset.share),"
        " Number(tr.dataset.owed), [...tr.children].map(td => td.textContent)])"
    )
    assert [r[0] for r in rows] == ["team-b", "team-a"]  # the larger share first
    assert [x for r in rows for x in r[1:3]] == pytest.approx([0.7, 0.75, 0.3, 0.25])
    assert rows[0][3] == ["team-b", "3", "standard", "1", "0", "70% (owed 75%)"]
    assert rows[1][3] == ["team-a", "1", "standard", "1", "0", "30% (owed 25%)"]
    owed_mark = chat.locator('tr[data-tenant="team-b"] .mark').evaluate("m => m.style.left")
    assert owed_mark == "75%"  # the owed mark on the share bar

    batch = page.locator('[data-tenant-class="batch"] .fairness')
    assert batch.get_attribute("data-verdict") == "none"
    assert batch.get_attribute("data-index") == ""
    assert batch.inner_text() == "batch: fairness not judged: fewer than two tenants waited"

    page.wait_for_selector("#log tbody tr")
    log = page.locator("#log tbody tr").evaluate_all(
        "trs => trs.map(tr => [tr.querySelector('.d-tenant').textContent, tr.dataset.outcome])"
    )
    assert ("team-a", "admitted") in [tuple(r) for r in log]
    assert ("team-b", "admitted") in [tuple(r) for r in log]
    page.screenshot(path=str(artifacts / "status-tenants.png"), full_page=True)
    assert strays == []


def test_the_tenants_panel_stays_hidden_while_no_tenant_is_active(page: Page) -> None:
    engine = EngineConfig(name="e0", models=frozenset({"m"}))
    strays = open_status_page(page, proxy_reads(Scheduler([engine], VirtualClock())))
    page.wait_for_selector('#connection[data-state="live"]')
    page.wait_for_selector('[data-engine="e0"]')
    assert page.locator("#tenants").is_hidden()
    assert page.locator("[data-tenant-class]").count() == 0
    assert strays == []
