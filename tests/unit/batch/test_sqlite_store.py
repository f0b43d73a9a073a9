"""The SQLite store on a real database file: what the runner's exactly once rests on."""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.batch.lines import answered, quality, read_lines
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import LineError, LineResult, NewBatch

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
SCHEMA = {"type": "json_schema", "json_schema": {"schema": {"required": ["a"]}}}


def jsonl(n: int) -> bytes:
    body = {"model": "tiny", "messages": []}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body} for i in range(n)]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    s = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await s.open()
    yield s
    await s.close()


async def new_job(store: SQLiteStore, n: int, batch_id: str = "batch_1") -> None:
    new = NewBatch(batch_id, CHAT, "file-x", "24h", 86400, None)
    await store.create_batch(new, read_lines(io.BytesIO(jsonl(n)), CHAT, 1000))


async def test_schema_is_versioned_and_wal(store: SQLiteStore) -> None:
    with sqlite3.connect(store.path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_version_1_store_is_migrated_and_keeps_its_jobs(tmp_path: Path) -> None:
    old = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await old.open()
    await new_job(old, 2)
    await old.close()
    with sqlite3.connect(tmp_path / "b.db") as db:  # back to schema 1: no `errors`
        db.execute("ALTER TABLE batches DROP COLUMN errors")
        db.execute("PRAGMA user_version = 1")
    store = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await store.open()
    batch = await store.get_batch("batch_1")
    assert batch is not None and (batch.total, batch.errors) == (2, None)
    failed = await store.fail_batch("batch_1", [{"code": "x", "message": "m"}])
    assert failed.errors == [{"code": "x", "message": "m"}]
    await store.close()


async def test_an_unknown_schema_version_stops_the_store(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "b.db") as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(RuntimeError, match="schema 99"):
        await SQLiteStore(tmp_path / "b.db", lambda: 0.0).open()


async def test_a_line_is_recorded_once(store: SQLiteStore) -> None:
    await new_job(store, 3)
    result = answered("c1", 200, {"choices": []}, {})
    assert await store.record("batch_1", 2, result)
    assert not await store.record("batch_1", 2, LineResult(False, "{}"))
    batch = await store.get_batch("batch_1")
    assert batch is not None and (batch.total, batch.completed, batch.failed) == (3, 1, 0)
    assert [p.idx for p in await store.pending_lines("batch_1", 0, 10)] == [1, 3]
    assert [p.idx for p in await store.pending_lines("batch_1", 1, 1)] == [3]


async def test_a_bad_job_stores_nothing(store: SQLiteStore) -> None:
    bad = jsonl(2) + jsonl(1)  # c0 again on line 3
    new = NewBatch("batch_2", CHAT, "file-x", "24h", 86400, None)
    with pytest.raises(LineError, match="Line 3: duplicate custom_id `c0`"):
        await store.create_batch(new, read_lines(io.BytesIO(bad), CHAT, 1000))
    assert await store.get_batch("batch_2") is None


async def test_a_job_is_validating_until_its_lines_are_stored(store: SQLiteStore) -> None:
    added = await store.add_batch(NewBatch("batch_3", CHAT, "file-x", "24h", 86400, None))
    assert (added.status, added.total, added.expires_at) == ("validating", 0, 1000 + 86400)
    assert "in_progress_at" not in added.times
    bad = jsonl(2) + b"{not json\n"
    with pytest.raises(LineError, match="Line 3"):
        await store.fill_batch("batch_3", read_lines(io.BytesIO(bad), CHAT, 1000))
    still = await store.get_batch("batch_3")
    assert still is not None and (still.status, still.total) == ("validating", 0)
    assert await store.pending_lines("batch_3", 0, 10) == []
    filled = await store.fill_batch("batch_3", read_lines(io.BytesIO(jsonl(4)), CHAT, 1000))
    assert (filled.status, filled.total, filled.times["in_progress_at"]) == ("in_progress", 4, 1000)
    assert [p.idx for p in await store.pending_lines("batch_3", 0, 10)] == [1, 2, 3, 4]


async def test_expiry_records_an_error_line_for_each_line_left(store: SQLiteStore) -> None:
    await new_job(store, 3)
    await store.record("batch_1", 2, LineResult(True, '{"custom_id": "c1"}'))
    assert await store.expire_pending("batch_1", lambda c: LineResult(False, c)) == 2
    assert await store.pending_lines("batch_1", 0, 10) == []
    done = await store.finalize("batch_1", "expired")
    assert (done.completed, done.failed, done.status) == (1, 2, "expired")
    assert done.error_file_id is not None and done.times["expired_at"] == 1000
    assert store.file_path(done.error_file_id).read_text() == "c0\nc2\n"


async def test_finalize_twice_writes_the_same_files(store: SQLiteStore) -> None:
    await new_job(store, 2)
    await store.record("batch_1", 1, LineResult(True, '{"custom_id": "c0"}'))
    await store.record("batch_1", 2, LineResult(False, '{"custom_id": "c1"}'))
    first = await store.finalize("batch_1", "completed")
    again = await store.finalize("batch_1", "completed")
    assert (first.output_file_id, first.error_file_id) == (
        again.output_file_id,
        again.error_file_id,
    )
    assert first.output_file_id is not None and first.error_file_id is not None
    out = store.file_path(first.output_file_id).read_text()
    assert out == '{"custom_id": "c0"}\n'
    assert store.file_path(first.error_file_id).read_text() == '{"custom_id": "c1"}\n'
    assert again.status == "completed" and again.times["completed_at"] == 1000


@pytest.mark.parametrize(
    ("format_", "text", "expected"),
    [
        (None, "{}", ""),
        ({"type": "json_object"}, '{"a": 1}', "valid"),
        ({"type": "json_object"}, "not json", "invalid"),
        ({"type": "json_schema", "json_schema": {"schema": {"required": ["a"]}}}, "{}", "invalid"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"required": ["a"]}}},
            '{"a":1}',
            "valid",
        ),
    ],
)
async def test_structured_answers_are_checked(
    format_: dict[str, object] | None, text: str, expected: str
) -> None:
    asked = {"response_format": format_} if format_ else {}
    answer = {"choices": [{"message": {"content": text}}]}
    assert quality(asked, answer) == expected
