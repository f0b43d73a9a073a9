"""The two walks through the proxy, counted: which modules of ``proxy/`` one chat
request enters, and one batch line, and how many times (calls begun from another
module: a call within a module, or a coroutine resumed, is not an entry; a call from
the framework or the event loop is). ``docs/architecture.md`` draws them.

The proxy runs in-process in front of a fake engine (``httpx.MockTransport``: a
three-token stream), batch on over SQLite in a temporary folder. Counted: one
streamed chat after a warm-up chat; one batch job of one line, from its creation
(``POST /v1/batches``) to its completed status, read from the SQLite file itself
(the route, the runner, the store, the request path; the proxy's own loops, the
tick every 50 ms and the engine monitor, are counted too while it runs).

    python -m loadtests.bench.walks            # a table, module by module
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sqlite3
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

MODEL = "m"
RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR
USAGE = {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3}


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _chat_stream() -> bytes:
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL}

    def chunk(**delta: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return _sse({**head, "choices": [choice]})

    parts = [chunk(role="assistant", content="")] + [chunk(content=t) for t in "abc"]
    parts.append(_sse({**head, "choices": [], "usage": USAGE}))
    return b"".join(parts) + b"data: [DONE]\n\n"


async def _streamed(data: bytes) -> AsyncIterator[bytes]:
    """The body as an engine's stream: read once, as it comes."""
    for i in range(0, len(data), 64):
        yield data[i : i + 64]


def engine(request: httpx.Request) -> httpx.Response:
    """A vLLM-shaped engine: models, health, metrics, tokenize, a chat stream."""
    path = request.url.path
    if path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
    if path == "/tokenize":
        return httpx.Response(200, json={"count": 12, "max_model_len": 4096})
    if path == "/metrics":
        return httpx.Response(200, text="")
    if path == "/v1/chat/completions":
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=_streamed(_chat_stream())
        )
    return httpx.Response(200)


@contextmanager
def counting(counts: Counter[str]) -> Iterator[None]:
    """Count, per module of ``proxy``, the calls into it from elsewhere while the
    block runs."""

    entered: dict[int, FrameType] = {}  # coroutine and generator frames begun (kept)

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("proxy."):
            return
        if frame.f_code.co_flags & RESUMABLE:
            if id(frame) in entered:
                return  # a resumption, not a call
            entered[id(frame)] = frame
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if caller != module:  # entered from outside: a step of the walk
            counts[module] += 1

    previous: Callable[..., Any] | None = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


async def walk(store: Path) -> tuple[Counter[str], Counter[str]]:
    from proxy.config import EngineConfig, Settings
    from proxy.server import create_app

    settings = Settings.from_keys(
        engines=(EngineConfig(url="http://a.engine.test:8000", name="a", models=(MODEL,)),),
        batch_store_path=str(store),
    )
    app = create_app(settings, transport=httpx.MockTransport(engine))
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": chat_body}
    chat, batch = Counter[str](), Counter[str]()
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            (await http.post("/v1/chat/completions", json=chat_body)).raise_for_status()
            with counting(chat):
                (await http.post("/v1/chat/completions", json=chat_body)).raise_for_status()
            files = {"file": ("in.jsonl", json.dumps(line).encode() + b"\n")}
            up = await http.post("/v1/files", files=files, data={"purpose": "batch"})
            ask = {"input_file_id": up.json()["id"], "endpoint": line["url"]}
            with counting(batch):
                made = await http.post("/v1/batches", json={**ask, "completion_window": "24h"})
                await _completed(store, made.json()["id"])
    return chat, batch


async def _completed(store: Path, batch_id: str) -> None:
    """Until the job is completed, read from the SQLite file itself (no proxy code)."""
    for _ in range(1000):
        with sqlite3.connect(store) as db:
            row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is not None and row[0] == "completed":
            return
        await asyncio.sleep(0.005)
    raise RuntimeError("the batch job did not complete")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        chat, batch = asyncio.run(walk(Path(folder) / "b.db"))
    walks = (("one chat request", chat), ("one batch line, created to completed", batch))
    for name, counts in walks:
        print(f"{name}: {sum(counts.values())} entries into {len(counts)} modules")
        for module, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {n:6d}  {module}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
