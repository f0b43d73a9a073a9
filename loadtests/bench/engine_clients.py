"""What an engine client costs per streamed token, client by client.

The proxy reads every token of every answer from an engine. This measures that
read alone, in one process with nothing else in it: ``--streams`` streamed chat
requests at once to the overhead benchmark's upstream (``overhead_upstream``, in its
own process), each of ``--tokens`` tokens, read to their ends; the CPU time of this
process over the tokens read. Arms:

- ``httpx-plain``: the proxy's client, ``httpx.AsyncClient`` on
  :class:`proxy.engines.PlainHTTPTransport` (httptools' C parser), body read with
  :func:`proxy.engines.raw_chunks`;
- ``httpx``: ``httpx.AsyncClient`` on its own transport (httpcore, h11);
- ``aiohttp``: ``aiohttp.ClientSession`` (its C parser), body read with
  ``iter_any()``: only where aiohttp is installed (it is no dependency of the
  project's: ``pip install aiohttp``).

Run: ``python -m loadtests.bench.engine_clients --upstream http://127.0.0.1:PORT``
(start ``python -m loadtests.bench.overhead_upstream --port PORT`` first).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from proxy.engines import PlainHTTPTransport, raw_chunks

Reader = Callable[[str, bytes, int], Awaitable[int]]
"""``await read(url, body, streams)``: the chunks read from ``streams`` answers."""
HEADERS = {"content-type": "application/json"}


def chat_body(tokens: int) -> bytes:
    message = {"role": "user", "content": "x" * 1000}
    return json.dumps(
        {"model": "bench", "messages": [message], "max_tokens": tokens, "stream": True}
    ).encode()


async def read_httpx(client: httpx.AsyncClient, url: str, body: bytes, streams: int) -> int:
    async def one() -> int:
        chunks = 0
        async with client.stream("POST", url, content=body, headers=HEADERS) as response:
            async for _ in raw_chunks(response):
                chunks += 1
        return chunks

    return sum(await asyncio.gather(*(one() for _ in range(streams))))


async def httpx_plain(url: str, body: bytes, streams: int) -> int:
    transport = PlainHTTPTransport(fallback=httpx.AsyncHTTPTransport())
    async with httpx.AsyncClient(transport=transport, timeout=None) as client:
        return await read_httpx(client, url, body, streams)


async def httpx_own(url: str, body: bytes, streams: int) -> int:
    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        return await read_httpx(client, url, body, streams)


async def aiohttp_session(url: str, body: bytes, streams: int) -> int:
    aiohttp: Any = importlib.import_module("aiohttp")  # only where installed (no dependency)

    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> int:
            chunks = 0
            async with session.post(url, data=body, headers=HEADERS) as response:
                async for _ in response.content.iter_any():
                    chunks += 1
            return chunks

        return sum(await asyncio.gather(*(one() for _ in range(streams))))


ARMS: dict[str, Reader] = {
    "httpx-plain": httpx_plain,
    "httpx": httpx_own,
    "aiohttp": aiohttp_session,
}


def available() -> list[str]:
    arms = ["httpx-plain", "httpx"]
    if importlib.util.find_spec("aiohttp") is not None:
        arms.append("aiohttp")
    return arms


async def measure(arm: str, url: str, streams: int, tokens: int, rounds: int) -> dict[str, float]:
    """One arm: a warm-up round, then ``rounds`` rounds measured."""
    read, body = ARMS[arm], chat_body(tokens)
    await read(url, body, streams)
    chunks, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
    for _ in range(rounds):
        chunks += await read(url, body, streams)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "chunks": chunks,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "cpu_us_per_chunk": round(1e6 * cpu / max(chunks, 1), 2),
        "chunks_per_cpu_s": round(chunks / cpu) if cpu else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the upstream's base URL")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(available()))
    args = parser.parse_args()
    url = args.upstream.rstrip("/") + "/v1/chat/completions"
    import uvloop  # as the proxy serves (uvicorn's standard extras bring it)

    print("| client | chunks | CPU s | CPU µs per chunk | chunks per CPU s |")
    print("|---|---|---|---|---|")
    for arm in args.arms.split(","):
        row = uvloop.run(measure(arm, url, args.streams, args.tokens, args.rounds))
        print(
            f"| {arm} | {row['chunks']:,} | {row['cpu_s']} | {row['cpu_us_per_chunk']} "
            f"| {row['chunks_per_cpu_s']:,} |"
        )


if __name__ == "__main__":
    main()
