"""The overhead benchmark's load generator, on raw asyncio so that it costs little.

Opens ``--streams`` streaming chat requests at once (one connection each), each with
a prompt of ``--prompt-chars`` characters and ``max_tokens`` ``--tokens``, and
prints one JSON line: TTFT and inter-token gap percentiles (seconds), the tokens
received, the wall time and the errors (a status other than 200, a short answer,
a connection error). A token is an event with a ``finish_reason`` key; tokens
that arrive in one read share its time.

Run: ``python -m loadtests.bench.overhead_load --url http://127.0.0.1:PORT/v1 --streams 64``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

TOKEN_MARK = b'"finish_reason"'
DONE_MARK = b"data: [DONE]"


@dataclass
class Result:
    """One stream as the client saw it."""

    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def request_bytes(url: str, prompt_chars: int, tokens: int) -> tuple[str, int, bytes]:
    """Host, port and the whole HTTP request for one streamed chat completion."""
    parts = urlsplit(url)
    body = json.dumps(
        {
            "model": "bench",
            "messages": [{"role": "user", "content": "x" * prompt_chars}],
            "max_tokens": tokens,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST {parts.path}/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    return parts.hostname or "127.0.0.1", parts.port or 80, head + body


async def one(host: str, port: int, request: bytes, tokens: int) -> Result:
    """Send one request and read its stream to ``[DONE]``."""
    result = Result(sent_at=time.monotonic())
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            result.error = head.split(b"\r\n", 1)[0].decode(errors="replace")
        else:
            await _read(reader, result)
        writer.close()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if result.error is None and len(result.token_times) != tokens:
        result.error = f"{len(result.token_times)} tokens of {tokens}"
    return result


async def _read(reader: asyncio.StreamReader, result: Result) -> None:
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            return
        now = time.monotonic()
        seen = tail + data
        result.token_times.extend([now] * (seen.count(TOKEN_MARK) - tail.count(TOKEN_MARK)))
        if DONE_MARK in seen:
            return
        tail = seen[-32:]


def summary(results: list[Result], wall_s: float) -> dict[str, object]:
    """The figures the benchmark prints, from the streams' results."""
    ttft = [r.token_times[0] - r.sent_at for r in results if r.token_times]
    gaps = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    errors = [r.error for r in results if r.error]
    return {
        "streams": len(results),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "itl_p50": percentile(gaps, 0.5),
        "itl_p99": percentile(gaps, 0.99),
        "tokens": sum(len(r.token_times) for r in results),
        "wall_s": wall_s,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


async def run(url: str, streams: int, prompt_chars: int, tokens: int) -> dict[str, object]:
    """All ``streams`` at once against ``url``; the :func:`summary`."""
    host, port, request = request_bytes(url, prompt_chars, tokens)
    start = time.monotonic()
    results = await asyncio.gather(*(one(host, port, request, tokens) for _ in range(streams)))
    return summary(list(results), time.monotonic() - start)


def raise_open_files() -> None:
    """Lift this process's open-file limit to its hard limit (1,024 streams need it)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="base URL ending in /v1")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-chars", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    raise_open_files()
    out = asyncio.run(run(args.url, args.streams, args.prompt_chars, args.tokens))
    sys.stdout.write(json.dumps(out) + "\n")
