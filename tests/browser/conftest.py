"""Fixtures of the browser tier: Debian's Chromium, headless, driven by Playwright.

The browser is the system one (``apt-get install chromium``), started through
Playwright's ``executable_path``: ``playwright install`` is never needed (it would
download a browser). A missing Chromium fails the tests; it never skips them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError as exc:  # pragma: no cover - the dev extra installs it
    raise ImportError(
        "the browser tests need the playwright package: pip install -e '.[dev]' "
        "(no `playwright install`: they drive Debian's chromium)"
    ) from exc

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"

# Flags that work on a CI machine with no display, no GPU and no network; the
# user-data dir is a fresh temporary one that Playwright makes for each launch.
CHROMIUM_FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium_path() -> str | None:
    """``$WHOSETURN_CHROMIUM``, else ``chromium`` on the PATH, else Debian's path."""
    candidates = (
        os.environ.get("WHOSETURN_CHROMIUM"),
        shutil.which("chromium"),
        "/usr/bin/chromium",
    )
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="session")
def chromium() -> str:
    path = chromium_path()
    if path is None:
        pytest.fail(
            "Chromium not found: run `apt-get install chromium` "
            "(or set WHOSETURN_CHROMIUM to a Chromium binary)",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=list(CHROMIUM_FLAGS), timeout=30_000
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page; a script error on it fails the test that used it."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000}, device_scale_factor=1)
    errors: list[str] = []
    try:
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(f"{error.name}: {error.message}"))
        yield page
    finally:
        context.close()
    if errors:
        pytest.fail(f"script errors on the page: {errors}", pytrace=False)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """``artifacts/`` at the repository root (git-ignored)."""
    (ARTIFACTS / "browser").mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
