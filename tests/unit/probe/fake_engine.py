"""A fake serializing engine behind ``httpx.MockTransport``, on the event loop's clock.

The decode stream emits a token every ``gap_s``; a one-token completion of ``n``
prompt tokens takes ``n * per_token_s`` and holds the stream for all of it (the
stream's next token waits until the prefill is done), as a serializing engine does.
``/tokenize`` maps each word to one token id, so prompts come out exactly sized.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "tiny"


@dataclass
class FakeEngine:
    gap_s: float = 0.002
    per_token_s: float = 0.00002
    max_model_len: int = 4096
    stream_tokens: int | None = None
    """End the decode stream after this many tokens (None: run until closed)."""
    completion_status: int = 200
    slow_calls: frozenset[int] = frozenset()
    """Indices of one-token completions (from 0) that take five times as long."""
    completions: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    streams_closed: int = 0
    _busy_until: float = 0.0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            card = {"id": MODEL, "object": "model", "max_model_len": self.max_model_len}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        body = json.loads(request.content)
        self.requests.append({"path": path, **body})
        if path == "/tokenize":
            ids = [zlib.crc32(w.encode()) % 30000 for w in body["prompt"].split()]
            return httpx.Response(200, json={"tokens": ids, "count": len(ids)})
        if path == "/v1/completions" and body.get("stream"):
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(200, content=self._stream(), headers=headers)
        if path == "/v1/completions":
            return await self._prefill(len(body["prompt"]))
        return httpx.Response(404)

    async def _prefill(self, tokens: int) -> httpx.Response:
        if self.completion_status != 200:
            return httpx.Response(self.completion_status, json={"error": {"message": "no"}})
        duration = tokens * self.per_token_s * (5 if self.completions in self.slow_calls else 1)
        self.completions += 1
        self._busy_until = asyncio.get_running_loop().time() + duration
        await asyncio.sleep(duration)
        return httpx.Response(200, json={"choices": [{"text": " x", "finish_reason": "length"}]})

    async def _stream(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        try:
            count = 0
            while self.stream_tokens is None or count < self.stream_tokens:
                await asyncio.sleep(self.gap_s)
                await asyncio.sleep(max(0.0, self._busy_until - loop.time()))
                count += 1
                last = self.stream_tokens is not None and count == self.stream_tokens
                choice = {"index": 0, "text": " 4", "finish_reason": "length" if last else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            self.streams_closed += 1
