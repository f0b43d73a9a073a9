"""What aborting batch requests in prefill for chats buys chat and costs batch:
``python -m loadtests.bench.aborts``. Prints numbers; it is not a test.

For each mode of ``--modes`` (``batch_abort`` values, run in that order, so
``off,on,off,on`` alternates them) a fresh simulated engine (a child process,
default flags: chunked prefill in 2,048-token steps, no long-prefill threshold)
and a fresh ``whoseturn serve`` in front of it run ``--prompts`` batch requests
of ``--words`` prompt words at once (``/batch/v1/completions``, no shared
prefix) while one-token chats arrive every ``--chat-every`` seconds until the
batch is done. Printed per run: the chats' time to answer (p50, p95, max), the
batch's time and the aborts the proxy counted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from loadtests.engine_io import samples
from loadtests.support import processes
from loadtests.support.markdown import markdown_table

MODEL = "tiny"


def batch_body(n: int, words: int) -> dict[str, object]:
    """Words of their own, so no two prompts share a prefix."""
    prompt = " ".join(f"a{n}w{i}" for i in range(words))
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8}


async def load(
    url: str, prompts: int, words: int, chat_every_s: float
) -> tuple[list[float], float]:
    """The chats' times to answer, and the batch's time."""
    took: list[float] = []
    done = asyncio.Event()

    async def chat(client: httpx.AsyncClient, n: int) -> None:
        messages = [{"role": "user", "content": f"Quick question {n}?"}]
        sent = time.monotonic()
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        took.append(time.monotonic() - sent)

    async def chats(client: httpx.AsyncClient) -> None:
        async with asyncio.TaskGroup() as group:
            while not done.is_set():
                group.create_task(chat(client, len(took)))
                await asyncio.sleep(chat_every_s)

    async def batch(client: httpx.AsyncClient, n: int) -> None:
        response = await client.post("/batch/v1/completions", json=batch_body(n, words))
        response.raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        chatting = asyncio.create_task(chats(client))
        start = time.monotonic()
        try:
            await asyncio.gather(*(batch(client, n) for n in range(prompts)))
        finally:
            done.set()
        seconds = time.monotonic() - start
        await chatting
    return took, seconds


def run(folder: Path, n: int, mode: str, args: argparse.Namespace) -> list[str]:
    """One run with ``batch_abort: mode``: its row of the table."""
    sim_port, port = processes.free_port(), processes.free_port()
    sim_url, url = processes.loopback_url(sim_port), processes.loopback_url(port)
    sim = processes.whoseturn_command(
        "sim", "--profile", "cpu-tiny", "--served-model-name", MODEL, "--port", str(sim_port)
    )
    engine = {"url": sim_url, "name": "sim", "models": [MODEL], "piecing": args.piecing}
    serve = processes.serve_command(
        folder / f"{n}-{mode}.yaml", port=port, engines=[engine],
        ttft_target_s=args.ttft_target, batch_abort=mode,
    )  # fmt: skip
    with processes.running(sim), processes.running(serve) as proxy:
        processes.wait_until_ok(sim_url + "/health", timeout_s=30)
        processes.wait_until_ok(url + "/readyz", process=proxy, timeout_s=30)
        took, seconds = asyncio.run(load(url, args.prompts, args.words, args.chat_every))
        metrics = httpx.get(url + "/metrics", timeout=10).text
    p95 = statistics.quantiles(took, n=20)[18] if len(took) >= 2 else took[0]
    aborts = samples(metrics).get("whoseturn_batch_aborts_total", 0.0)
    return [
        mode, str(len(took)), f"{statistics.median(took) * 1000:,.0f} ms",
        f"{p95 * 1000:,.0f} ms", f"{max(took) * 1000:,.0f} ms", f"{seconds:.2f} s",
        f"{aborts:.0f}",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="off,on,off,on", help="batch_abort per run")
    parser.add_argument("--piecing", default="off", choices=["off", "on"])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--words", type=int, default=6000, help="prompt words (tokens)")
    parser.add_argument("--chat-every", type=float, default=0.05, help="seconds")
    parser.add_argument("--ttft-target", type=float, default=0.3, help="ttft_target_s")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(Path(tmp), n, mode, args) for n, mode in enumerate(args.modes.split(","))]
    print(
        f"{args.prompts} batch prompts of {args.words} words at once, a one-token chat "
        f"every {args.chat_every:g} s, piecing {args.piecing}, ttft_target_s "
        f"{args.ttft_target:g}, simulated engine (cpu-tiny, default flags, real time)"
    )
    header = ["batch_abort", "chats", "chat p50", "chat p95", "chat max", "batch", "aborts"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
