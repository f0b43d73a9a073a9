"""A newcomer's batch job with no configuration at all: ``whoseturn serve --engine
URL`` (no config file, no store settings) and the official ``openai`` client's
``files.create`` + ``batches.create``, polled to ``completed``. The store is the
default one, SQLite under the data directory (here the test session's
``$XDG_DATA_HOME``: tests/conftest.py), and the proxy says so at start."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import openai

from .proxyserver import spawn_proxy, spawn_sim


def test_a_batch_job_runs_to_completed_with_no_config(tmp_path: Path) -> None:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"summarise document {i}"}],
                "max_tokens": 8,
            },
        }
        for i in range(5)
    ]
    jsonl = tmp_path / "jobs.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with spawn_sim() as sim, spawn_proxy(sim.base_url) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url + "/v1", api_key="unused", max_retries=0)
        with jsonl.open("rb") as f:
            uploaded = client.files.create(file=f, purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None and batch.request_counts.completed == 5
        assert batch.output_file_id is not None
        out = client.files.content(batch.output_file_id).text.splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in out) == [f"line-{i}" for i in range(5)]
    store = Path(os.environ["XDG_DATA_HOME"]) / "whoseturn" / "batch.sqlite3"
    assert store.exists()
