"""Workload files' classes as the tests write them: chat requests on the chat route,
completions on the batch route (the format: :mod:`loadtests.harness.workload_file`)."""

from __future__ import annotations

from typing import Any


def chat_class(arrival: dict[str, Any], *, chars: int, max_tokens: int) -> dict[str, Any]:
    """A ``classes`` entry: chat requests of ``chars`` prompt characters to the chat
    route, sent as ``arrival`` says."""
    return _workload_class("chat", "chat", arrival, chars, max_tokens)


def batch_class(*, concurrency: int, chars: int, max_tokens: int) -> dict[str, Any]:
    """A ``classes`` entry: ``concurrency`` completions requests at a time (a closed
    loop) of ``chars`` prompt characters to the batch route."""
    arrival = {"process": "closed", "concurrency": concurrency}
    return _workload_class("batch", "completions", arrival, chars, max_tokens)


def _workload_class(
    route: str, api: str, arrival: dict[str, Any], chars: int, max_tokens: int
) -> dict[str, Any]:
    return {
        "route": route,
        "api": api,
        "arrival": arrival,
        "prompt": {"chars": chars},
        "max_tokens": max_tokens,
    }
