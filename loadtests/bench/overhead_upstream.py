"""An engine that costs nothing, for the overhead benchmark (:mod:`loadtests.bench.overhead`).

A minimal OpenAI-compatible HTTP/1.1 server on raw asyncio: ``POST
/v1/chat/completions`` and ``/v1/completions`` stream ``--tokens`` tokens, the first
at once and then one per ``--interval`` seconds (one timer for all streams, so the
server's own cost stays small), ending with a usage chunk and ``[DONE]``;
``/v1/models``, ``/health``, a minimal ``/metrics`` and ``/tokenize`` (one token per
four bytes of the body) answer from memory. Keep-alive; chunked responses.

Run: ``python -m loadtests.bench.overhead_upstream --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field

MODEL = "bench"
METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"


@dataclass
class Stream:
    """One answer being streamed: where to, how many tokens are left, its framing."""

    writer: asyncio.StreamWriter
    left: int
    total: int
    prompt_tokens: int
    chat: bool
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(data: object) -> bytes:
    return _chunk(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")


def token_event(chat: bool, index: int, last: bool) -> bytes:
    """One token's SSE event (``finish_reason`` ``length`` on the last)."""
    finish = "length" if last else None
    if chat:
        choice: dict[str, object] = {"index": 0, "delta": {"content": f" t{index}"}}
    else:
        choice = {"index": 0, "text": f" t{index}"}
    choice["finish_reason"] = finish
    obj = "chat.completion.chunk" if chat else "text_completion"
    return _event({"id": "b", "object": obj, "model": MODEL, "choices": [choice]})


class Upstream:
    """The server's state: the streams in flight and the token timer."""

    def __init__(self, tokens: int, interval_s: float) -> None:
        self.tokens = tokens
        self.interval_s = interval_s
        self.streams: list[Stream] = []

    async def tick(self) -> None:
        """Every ``interval_s``: one more token to every stream."""
        while True:
            await asyncio.sleep(self.interval_s)
            alive = []
            for s in self.streams:
                self._advance(s)
                if s.left > 0:
                    alive.append(s)
                else:
                    s.done.set()
            self.streams = alive

    def _advance(self, s: Stream) -> None:
        index = s.total - s.left
        s.left -= 1
        data = token_event(s.chat, index, s.left == 0)
        if s.left == 0:
            usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.total}
            usage["total_tokens"] = s.prompt_tokens + s.total
            data += _event({"id": "b", "model": MODEL, "choices": [], "usage": usage})
            data += _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        if not s.writer.is_closing():
            s.writer.write(data)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve requests on one connection until the client closes it."""
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, path = lines[0].split(" ")[:2]
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        body = await reader.readexactly(length) if length else b""
        if method == "POST" and path.endswith("/completions"):
            await self._stream(writer, path, body)
        else:
            status, payload, ctype = _plain(path, body)
            writer.write(
                b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                % (status, ctype, len(payload), payload)
            )
        await writer.drain()
        return True

    async def _stream(self, writer: asyncio.StreamWriter, path: str, body: bytes) -> None:
        request = json.loads(body)
        total = int(request.get("max_tokens") or self.tokens)
        chat = path.endswith("chat/completions")
        s = Stream(writer, total, total, max(1, len(body) // 4), chat)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        self._advance(s)
        if s.left > 0:
            self.streams.append(s)
            await s.done.wait()


def _plain(path: str, body: bytes) -> tuple[bytes, bytes, bytes]:
    """Status, body and content type for the non-streaming routes."""
    if path.startswith("/v1/models"):
        data = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        return b"200 OK", json.dumps(data).encode(), b"application/json"
    if path.startswith("/tokenize"):
        count = max(1, len(body) // 4)
        data2 = {"count": count, "max_model_len": 1 << 20, "tokens": [0] * count}
        return b"200 OK", json.dumps(data2).encode(), b"application/json"
    if path.startswith("/metrics"):
        return b"200 OK", METRICS, b"text/plain"
    if path.startswith("/health"):
        return b"200 OK", b"", b"text/plain"
    return b"404 Not Found", b"{}", b"application/json"


async def main(port: int, tokens: int, interval_s: float) -> None:
    """Serve on loopback ``port`` until cancelled."""
    upstream = Upstream(tokens, interval_s)
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await asyncio.gather(server.serve_forever(), upstream.tick())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--interval", type=float, default=0.020)
    args = parser.parse_args()
    asyncio.run(main(args.port, args.tokens, args.interval))
