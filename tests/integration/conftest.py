"""Fixtures of the integration tier: simulated engines on loopback sockets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .simserver import SimServer, run_server, sim_settings


@pytest.fixture
def sim() -> Iterator[SimServer]:
    """A fresh simulated engine (cpu-tiny, 2,048-token context, 20x real time)."""
    with run_server(sim_settings()) as server:
        yield server


@pytest.fixture
def slow_sim() -> Iterator[SimServer]:
    """A simulated engine in real time: a long answer is still running when a test
    hangs up, and the engine does nothing but the request under test."""
    with run_server(sim_settings(time_scale=1.0)) as server:
        yield server


@pytest.fixture(scope="module")
def shared_sim() -> Iterator[SimServer]:
    """One simulated engine for a whole module, for tests that do not read metrics."""
    with run_server(sim_settings()) as server:
        yield server
