"""The batch store's benchmark: ``python -m loadtests.bench.batch_store``. Prints numbers;
it is not a test.

For each store in ``--stores`` (``sqlite``, ``postgres``):

1. **Store alone**: lines recorded per second (a job of ``--store-lines`` lines,
   claimed a window at a time and ``--window`` records in flight at once, as the
   runner does), on a database in a temporary folder or a fresh PostgreSQL
   database.
2. **Whole proxy**: ``whoseturn serve`` (a child process) in front of a fast
   simulated engine (another child) runs a job of ``--job-lines`` lines through the
   scheduler; lines recorded per second, and the proxy's peak RSS growth (its
   ``VmHWM`` before the upload against after the run). The run stops after
   ``--max-s`` seconds if the job is not done by then; what was done is reported.
3. **Chat beside a job** (``--ttft``): one ``whoseturn serve`` in front of one
   simulated engine; the same chat load (``--chat-clients`` streaming clients, one
   short question after another) for ``--chat-s`` seconds with no batch work, then
   again while a Batch API job of long prompts runs at full speed (the runner's
   window full). Prints chat TTFT p50 and p95 of both phases, their ratio, and the
   job's lines per second during the second phase. The integration test
   ``tests/integration/test_batch_chat_ttft.py`` runs the same function.

PostgreSQL: ``--dsn`` names a server to use (a new database is made on it for each
run: the role needs CREATEDB); without it a throwaway cluster of Debian's
``postgresql`` is started with PostgreSQL's default durability (fsync on,
synchronous commits).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from loadtests.support import processes
from loadtests.support.postgres import fresh_database, postgres_cluster
from proxy.batch.lines import answered, read_lines
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import BatchStore, NewBatch
from proxy.openai.answers import Answer

CHAT = "/v1/chat/completions"
MODEL = "tiny"


def job_file(lines: int) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out = io.StringIO()
    for i in range(lines):
        out.write(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": CHAT, "body": body}))
        out.write("\n")
    return out.getvalue().encode()


async def store_rate(make: Callable[[], BatchStore], lines: int, window: int) -> float:
    """Lines recorded per second by the store alone."""
    store = make()
    await store.open()
    await store.add_batch(NewBatch("batch_bench", CHAT, "file-bench", "24h", 86400, None))
    await store.fill_batch("batch_bench", read_lines(io.BytesIO(job_file(lines)), CHAT, lines))
    body = {"object": "chat.completion", "choices": [{"message": {"content": "ok"}}]}
    answer = Answer.of(200, body)
    start = time.perf_counter()
    while page := await store.claim("batch_bench", "bench", window, 60):
        async with anyio.create_task_group() as group:
            for line in page:
                result = answered(line.custom_id, answer, line.body)
                group.start_soon(store.record, "batch_bench", line.idx, result)
    elapsed = time.perf_counter() - start
    await store.finalize("batch_bench", "completed")
    await store.close()
    return lines / elapsed


class Stores:
    """Where each store's runs keep their data: a folder, or databases on a server."""

    def __init__(self, folder: Path, dsn: str | None, stack: ExitStack) -> None:
        self.folder = folder
        self._dsn = dsn
        self._stack = stack
        self._runs = 0

    def admin_dsn(self) -> str:
        if self._dsn is None:
            self._dsn = self._stack.enter_context(postgres_cluster(durable=True)).dsn()
        return self._dsn

    def factory(self, kind: str) -> Callable[[], BatchStore]:
        self._runs += 1
        if kind == "sqlite":
            path = self.folder / f"bench-{self._runs}.db"
            return lambda: SQLiteStore(path, time.time)
        from proxy.batch.postgres import PostgresStore

        dsn = fresh_database(self.admin_dsn(), "bench")
        return lambda: PostgresStore(dsn, time.time)

    def settings(self, kind: str) -> dict[str, Any]:
        self._runs += 1
        if kind == "sqlite":
            return {"batch_store_path": str(self.folder / f"proxy-{self._runs}.db")}
        return {"batch_store": "postgres", "batch_dsn": fresh_database(self.admin_dsn(), "bench")}


def peak_rss_kb(pid: int) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1])
    raise RuntimeError("no VmHWM")


def proxy_run(folder: Path, kind: str, store: dict[str, Any], lines: int, max_s: float) -> None:
    """Run a job through the whole proxy and print its rate and peak RSS growth."""
    sim_port, port = processes.free_port(), processes.free_port()
    sim_url, url = processes.loopback_url(sim_port), processes.loopback_url(port)
    sim = processes.whoseturn_command(
        "sim", "--profile", "cpu-tiny", "--served-model-name", MODEL,
        "--time-scale", "100", "--port", str(sim_port),
    )  # fmt: skip
    engine = {"url": sim_url, "name": "sim-0", "models": [MODEL]}
    data = job_file(lines)
    settings = {**store, "batch_max_lines": lines}
    serve = processes.serve_command(folder / "proxy.yaml", port=port, engines=[engine], **settings)
    with processes.running(sim), processes.running(serve) as proxy:
        processes.wait_until_ok(sim_url + "/health", timeout_s=30)
        processes.wait_until_ok(url + "/readyz", process=proxy, timeout_s=30)
        before = peak_rss_kb(proxy.pid)
        with httpx.Client(base_url=url, timeout=120) as http:
            sent = http.post("/v1/files", files={"file": ("job.jsonl", data)},
                             data={"purpose": "batch"})  # fmt: skip
            if sent.status_code != 200:
                raise RuntimeError(f"upload: HTTP {sent.status_code} {sent.text[:300]}")
            ask = {"input_file_id": sent.json()["id"], "endpoint": CHAT, "completion_window": "24h"}
            made = http.post("/v1/batches", json=ask)
            if made.status_code != 200:
                raise RuntimeError(f"create: HTTP {made.status_code} {made.text[:300]}")
            batch_id = made.json()["id"]
            start = time.monotonic()
            while True:
                batch = http.get(f"/v1/batches/{batch_id}").json()
                elapsed = time.monotonic() - start
                if batch["status"] == "completed" or elapsed > max_s:
                    break
                time.sleep(0.5)
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        growth_mb = (peak_rss_kb(proxy.pid) - before) / 1024
    print(f"proxy ({kind}): {done} of {lines} lines in {elapsed:.1f} s = "
          f"{done / elapsed:.0f} lines/s (status {batch['status']})")  # fmt: skip
    print(f"proxy ({kind}): peak RSS growth {growth_mb:.1f} MB (upload, validation, run)")


# -- chat TTFT beside a Batch API job -------------------------------------------------


@dataclass
class Beside:
    """Chat TTFTs (seconds) with no batch work and beside a running job; the job's
    lines recorded during the second phase, and that phase's length."""

    alone_s: list[float] = field(default_factory=list)
    beside_s: list[float] = field(default_factory=list)
    job_lines: int = 0
    job_phase_s: float = 0.0
    chat_errors: int = 0

    @staticmethod
    def p(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1]

    @property
    def ratio(self) -> float:
        """Chat TTFT p95 beside the job over chat TTFT p95 alone."""
        return self.p(self.beside_s, 95) / self.p(self.alone_s, 95)

    def lines(self) -> list[str]:
        def row(name: str, xs: list[float]) -> str:
            p50, p95 = self.p(xs, 50) * 1000, self.p(xs, 95) * 1000
            return f"chat TTFT {name}: p50 {p50:.1f} ms, p95 {p95:.1f} ms ({len(xs)} requests)"

        rate = self.job_lines / self.job_phase_s if self.job_phase_s else 0.0
        return [
            row("alone     ", self.alone_s),
            row("beside job", self.beside_s),
            f"ratio of p95s (beside / alone): {self.ratio:.2f}",
            f"the job meanwhile: {self.job_lines} lines in {self.job_phase_s:.1f} s "
            f"= {rate:.1f} lines/s",
        ]


def long_job_file(lines: int, words: int) -> bytes:
    """Lines with prompts of ``words`` words, each prompt's first word its own (no
    two share a prefix, so the engine's prefix cache does not help)."""
    out = io.StringIO()
    for i in range(lines):
        text = f"j{i} " + "w " * (words - 1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
        out.write(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": CHAT, "body": body}))
        out.write("\n")
    return out.getvalue().encode()


async def _chat_client(client: httpx.AsyncClient, n: int, until: float, out: Beside,
                       into: list[float]) -> None:  # fmt: skip
    asked = 0
    while time.monotonic() < until:
        asked += 1
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Quick question {n}.{asked}?"}],
            "max_tokens": 4,
            "stream": True,
        }
        sent, first = time.monotonic(), None
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                out.chat_errors += 1
                await response.aread()
                continue
            async for line in response.aiter_lines():
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = time.monotonic()
        if first is None:
            out.chat_errors += 1
        else:
            into.append(first - sent)
        await asyncio.sleep(0.02)


async def chat_load(url: str, clients: int, seconds: float, out: Beside, into: list[float]) -> None:
    """``clients`` streaming chat clients, one question after another, for ``seconds``."""
    until = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=30) as client, asyncio.TaskGroup() as group:
        for n in range(clients):
            group.create_task(_chat_client(client, n, until, out, into))


@contextmanager
def proxy_and_sim(folder: Path, time_scale: float, **settings: Any) -> Iterator[str]:
    """``whoseturn sim`` (cpu-tiny) and ``whoseturn serve`` with the Batch API on (and
    ``settings``); the proxy's URL once both answer."""
    sim_port, port = processes.free_port(), processes.free_port()
    sim_url, url = processes.loopback_url(sim_port), processes.loopback_url(port)
    sim = processes.whoseturn_command(
        "sim", "--profile", "cpu-tiny", "--served-model-name", MODEL,
        "--time-scale", str(time_scale), "--port", str(sim_port),
    )  # fmt: skip
    engine = {"url": sim_url, "name": "sim-0", "models": [MODEL]}
    store = {"batch_store_path": str(folder / "ttft.db"), "batch_max_lines": 100_000, **settings}
    serve = processes.serve_command(folder / "ttft.yaml", port=port, engines=[engine], **store)
    with processes.running(sim), processes.running(serve) as proxy:
        processes.wait_until_ok(sim_url + "/health", timeout_s=30)
        processes.wait_until_ok(url + "/readyz", process=proxy, timeout_s=30)
        yield url


def _recorded(http: httpx.Client, batch_id: str) -> tuple[str, int]:
    batch = http.get(f"/v1/batches/{batch_id}").json()
    counts = batch["request_counts"]
    return batch["status"], counts["completed"] + counts["failed"]


def chat_beside_job(
    folder: Path,
    *,
    chat_s: float = 10.0,
    chat_clients: int = 4,
    job_lines: int = 3000,
    prompt_words: int = 1000,
    time_scale: float = 10.0,
    **settings: Any,
) -> Beside:
    """The same chat load alone, then beside a Batch API job running at full speed
    (its first line already recorded); the job is cancelled at the end. Raises if
    the job ended before the chat phase did (make it longer). ``settings`` go to
    the proxy's configuration (``ttft_target_s``, ...)."""
    out = Beside()
    with (
        proxy_and_sim(folder, time_scale, **settings) as url,
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        asyncio.run(chat_load(url, chat_clients, 1.0, out, []))  # warm-up
        asyncio.run(chat_load(url, chat_clients, chat_s, out, out.alone_s))
        data = long_job_file(job_lines, prompt_words)
        up = http.post("/v1/files", files={"file": ("job.jsonl", data)}, data={"purpose": "batch"})
        assert up.status_code == 200, up.text
        ask = {"input_file_id": up.json()["id"], "endpoint": CHAT, "completion_window": "24h"}
        batch_id = http.post("/v1/batches", json=ask).json()["id"]
        while (found := _recorded(http, batch_id))[1] == 0:
            assert found[0] in ("validating", "in_progress"), found
            time.sleep(0.1)
        start, first = time.monotonic(), found[1]
        asyncio.run(chat_load(url, chat_clients, chat_s, out, out.beside_s))
        status, last = _recorded(http, batch_id)
        out.job_phase_s, out.job_lines = time.monotonic() - start, last - first
        assert status == "in_progress", f"the job ended ({status}) before the chat phase did"
        http.post(f"/v1/batches/{batch_id}/cancel")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.batch_store")
    parser.add_argument("--store-lines", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--job-lines", type=int, default=100_000)
    parser.add_argument("--max-s", type=float, default=60.0)
    parser.add_argument("--stores", default="sqlite,postgres", help="comma-separated")
    parser.add_argument("--dsn", help="a PostgreSQL server to use (default: a throwaway one)")
    parser.add_argument("--no-proxy", action="store_true", help="the store alone only")
    parser.add_argument("--ttft", action="store_true", help="only the chat-beside-a-job run")
    parser.add_argument("--chat-s", type=float, default=20.0)
    parser.add_argument("--chat-clients", type=int, default=4)
    parser.add_argument("--ttft-target-s", type=float, default=0.3)
    args = parser.parse_args()
    if args.ttft:
        with tempfile.TemporaryDirectory() as tmp:
            result = chat_beside_job(
                Path(tmp),
                chat_s=args.chat_s,
                chat_clients=args.chat_clients,
                job_lines=3500,  # 7 MB: under the default max_body_bytes
                ttft_target_s=args.ttft_target_s,
            )
        print("\n".join(result.lines()))
        return
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        stores = Stores(Path(tmp), args.dsn, stack)
        for kind in kinds:
            rate = anyio.run(store_rate, stores.factory(kind), args.store_lines, args.window)
            print(f"store ({kind}): {rate:.0f} lines/s recorded ({args.store_lines} lines)")
        for kind in [] if args.no_proxy else kinds:
            proxy_run(Path(tmp), kind, stores.settings(kind), args.job_lines, args.max_s)


if __name__ == "__main__":
    main()
