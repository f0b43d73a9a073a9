"""Fixtures of the e2e tier: real vLLM (CPU build) servers and the proxy in front.

``make test-e2e`` builds ``.venv-vllm`` and the small model, then runs these tests
with the proxy's own venv; the tests start and stop their vLLM servers
(:mod:`.vllmserver`). The terminal summary lists how long each server took to start
and what the tests measured (:func:`measured`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .vllmserver import VllmFleet, VllmServer

FLEET = pytest.StashKey[VllmFleet]()
MEASURED = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session")
def vllm_fleet(request: pytest.FixtureRequest) -> Iterator[VllmFleet]:
    """The session's vLLM servers, started on first use and stopped at the end."""
    fleet = VllmFleet()
    request.config.stash[FLEET] = fleet
    try:
        yield fleet
    finally:
        fleet.stop_all()


@pytest.fixture(scope="module")
def vllm(vllm_fleet: VllmFleet) -> VllmServer:
    """A server with vLLM's default flags (FCFS, chunked prefill), shared by every
    module that asks for it while no other server displaced it."""
    return vllm_fleet.get()


@pytest.fixture
def measured(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``measured(line)`` prints ``line`` and lists it, with the test's name, in the
    terminal summary."""
    lines = request.config.stash.setdefault(MEASURED, [])

    def record(line: str) -> None:
        print(line)
        lines.append(f"{request.node.name}: {line}")

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    fleet = terminalreporter.config.stash.get(FLEET, None)
    lines = terminalreporter.config.stash.get(MEASURED, [])
    if fleet is None or not (fleet.starts or lines):
        return
    terminalreporter.section("real vLLM")
    for flags, seconds in fleet.starts:
        terminalreporter.write_line(
            f"vLLM {' '.join(flags) or '(default flags)'}: ready in {seconds:.1f} s"
        )
    for line in lines:
        terminalreporter.write_line(line)
