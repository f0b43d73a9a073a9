"""The batch store's benchmark: ``python -m loadtests.batch_bench``. Prints numbers;
it is not a test.

1. **Store alone**: lines recorded per second by the SQLite store (a job of
   ``--store-lines`` lines, ``--window`` records in flight at once, as the runner
   keeps them), on a database in a temporary folder.
2. **Whole proxy**: ``whoseturn serve`` (a child process) in front of a fast
   simulated engine (another child) runs a job of ``--job-lines`` lines through the
   scheduler; lines recorded per second, and the proxy's peak RSS growth (its
   ``VmHWM`` before the upload against after the run). The run stops after
   ``--max-s`` seconds if the job is not done by then; what was done is reported.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from loadtests import processes
from proxy.batch.lines import answered, read_lines
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import NewBatch

CHAT = "/v1/chat/completions"
MODEL = "tiny"


def job_file(lines: int) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out = io.StringIO()
    for i in range(lines):
        out.write(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": CHAT, "body": body}))
        out.write("\n")
    return out.getvalue().encode()


async def store_rate(folder: Path, lines: int, window: int) -> float:
    """Lines recorded per second by the store alone."""
    store = SQLiteStore(folder / "bench.db", time.time)
    await store.open()
    new = NewBatch("batch_bench", CHAT, "file-bench", "24h", 86400, None)
    await store.create_batch(new, read_lines(io.BytesIO(job_file(lines)), CHAT, lines))
    body = {"object": "chat.completion", "choices": [{"message": {"content": "ok"}}]}
    start = time.perf_counter()
    after = 0
    while page := await store.pending_lines("batch_bench", after, window):
        async with anyio.create_task_group() as group:
            for line in page:
                result = answered(line.custom_id, 200, body, line.body)
                group.start_soon(store.record, "batch_bench", line.idx, result)
        after = page[-1].idx
    elapsed = time.perf_counter() - start
    await store.close()
    return lines / elapsed


def peak_rss_kb(pid: int) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1])
    raise RuntimeError("no VmHWM")


def proxy_run(folder: Path, lines: int, max_s: float) -> None:
    """Run a job through the whole proxy and print its rate and peak RSS growth."""
    sim_port, port = processes.free_port(), processes.free_port()
    sim_url, url = processes.loopback_url(sim_port), processes.loopback_url(port)
    sim = processes.whoseturn_command(
        "sim", "--profile", "cpu-tiny", "--served-model-name", MODEL,
        "--time-scale", "100", "--port", str(sim_port),
    )  # fmt: skip
    engine = {"url": sim_url, "name": "sim-0", "models": [MODEL]}
    store = {"batch_store_path": str(folder / "proxy.db"), "batch_max_lines": lines}
    serve = processes.serve_command(folder / "proxy.yaml", port=port, engines=[engine], **store)
    with processes.running(sim), processes.running(serve) as proxy:
        processes.wait_until_ok(sim_url + "/health", timeout_s=30)
        processes.wait_until_ok(url + "/readyz", process=proxy, timeout_s=30)
        before = peak_rss_kb(proxy.pid)
        with httpx.Client(base_url=url, timeout=120) as http:
            up = http.post("/v1/files", files={"file": ("job.jsonl", job_file(lines))},
                           data={"purpose": "batch"}).json()  # fmt: skip
            ask = {"input_file_id": up["id"], "endpoint": CHAT, "completion_window": "24h"}
            batch_id = http.post("/v1/batches", json=ask).json()["id"]
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
    print(f"proxy: {done} of {lines} lines in {elapsed:.1f} s = {done / elapsed:.0f} lines/s "
          f"(status {batch['status']})")  # fmt: skip
    print(f"proxy: peak RSS growth {growth_mb:.1f} MB (upload, validation, run)")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.batch_bench")
    parser.add_argument("--store-lines", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--job-lines", type=int, default=100_000)
    parser.add_argument("--max-s", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rate = anyio.run(store_rate, Path(tmp), args.store_lines, args.window)
        print(f"store: {rate:.0f} lines/s recorded (SQLite, {args.store_lines} lines)")
        proxy_run(Path(tmp), args.job_lines, args.max_s)


if __name__ == "__main__":
    main()
