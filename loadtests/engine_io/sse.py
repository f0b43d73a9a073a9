"""Server-sent events as an OpenAI-compatible engine streams them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx


async def sse_events(
    response: httpx.Response, clock: Callable[[], float]
) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """Each ``data:`` event of a streamed response, as ``(clock() when its line came,
    its JSON)``, up to ``data: [DONE]``. Other lines (comments, ``event:``) are skipped;
    an event that is not JSON raises :class:`ValueError`. The body is read to its end
    even after ``[DONE]``, so that its connection goes back to the client's pool."""
    done = False
    async for line in response.aiter_lines():
        if done or not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            done = True
            continue
        now = clock()
        yield now, json.loads(data)
