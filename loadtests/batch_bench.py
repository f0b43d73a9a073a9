"""The batch store's benchmark: ``python -m loadtests.batch_bench``. Prints numbers;
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

PostgreSQL: ``--dsn`` names a server to use (a new database is made on it for each
run: the role needs CREATEDB); without it a throwaway cluster of Debian's
``postgresql`` is started with PostgreSQL's default durability (fsync on,
synchronous commits).
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx

from loadtests import processes
from loadtests.postgres import fresh_database, postgres_cluster
from proxy.batch.lines import answered, read_lines
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import BatchStore, NewBatch

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
    new = NewBatch("batch_bench", CHAT, "file-bench", "24h", 86400, None)
    await store.create_batch(new, read_lines(io.BytesIO(job_file(lines)), CHAT, lines))
    body = {"object": "chat.completion", "choices": [{"message": {"content": "ok"}}]}
    start = time.perf_counter()
    while page := await store.claim("batch_bench", "bench", window, 60):
        async with anyio.create_task_group() as group:
            for line in page:
                result = answered(line.custom_id, 200, body, line.body)
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
    # The upload is one request body: the proxy's max_body_bytes (8 MiB by default)
    # applies to it before batch_max_file_bytes does.
    settings = {**store, "batch_max_lines": lines, "max_body_bytes": 2 * len(data)}
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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.batch_bench")
    parser.add_argument("--store-lines", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--job-lines", type=int, default=100_000)
    parser.add_argument("--max-s", type=float, default=60.0)
    parser.add_argument("--stores", default="sqlite,postgres", help="comma-separated")
    parser.add_argument("--dsn", help="a PostgreSQL server to use (default: a throwaway one)")
    parser.add_argument("--no-proxy", action="store_true", help="the store alone only")
    args = parser.parse_args()
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
