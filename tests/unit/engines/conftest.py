"""Fixtures of the engine-client tests: engines behind one mock transport."""

from __future__ import annotations

import pytest

from .helpers import FakeEngines


@pytest.fixture
def fake() -> FakeEngines:
    return FakeEngines()
