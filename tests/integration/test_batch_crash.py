"""Exactly once on SQLite: a 500-line job survives SIGKILLs of the proxy.

``whoseturn serve`` runs as a child process in front of a fast simulated engine
(another child);
it is killed with SIGKILL at random points while the lines run (twice), and once
while the job is finalizing, and restarted each time on the same store. The job
then completes with exactly one output or error line per ``custom_id``, and its
counts add up.

The output alone cannot show a line run twice (the store keeps a line's first
result), so the engine's own request log is read beside the store (each line's
body carries its ``custom_id`` as ``user``): no line reaches the engine after the
store has its result, whether a restart or the same run sends it again; and a
kill costs at most one more call of the lines it caught in flight (at most the
runner's window of them), never more.

To kill it *while finalizing* every time, not by luck, the test puts a directory
where the output file's temporary copy goes: finalizing fails there and is
retried, so the job stays ``finalizing`` (the store says so) until the proxy is
killed; the obstacle is removed before the restart.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import httpx
import pytest

from loadtests.sim.server.requestlog import LoggedRequest, RequestLogReader
from tests.support.processes import free_port, loopback_url, running, serve_command, wait_until_ok

from .proxyserver import Process, engine, spawn_sim
from .simserver import MODEL

pytestmark = pytest.mark.integration
LINES = 500
WINDOW = 64  # the runner's window: the most lines in flight at once


def job_lines(count: int = LINES, max_tokens: int = 2) -> bytes:
    """``count`` chat lines, each carrying its ``custom_id`` as ``user`` (what the
    engine's request log shows)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body["max_tokens"] = max_tokens
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**body, "user": f"line-{i}"},
        }
        for i in range(count)
    ]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def status(store: Path, batch_id: str) -> tuple[str, int]:
    """The job's status and how many lines have a result, read from the store."""
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        (state,) = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        sql = "SELECT COUNT(*) FROM lines WHERE batch_id = ? AND result IS NOT NULL"
        (done,) = db.execute(sql, (batch_id,)).fetchone()
    return state, done


def recorded(store: Path, batch_id: str) -> set[str]:
    """The ``custom_id`` of each line the store has a result for."""
    with closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as db:
        sql = "SELECT custom_id FROM lines WHERE batch_id = ? AND result IS NOT NULL"
        return {c for (c,) in db.execute(sql, (batch_id,))}


class Witness:
    """The engine's calls (its request log) beside the store's results, read while
    the job runs: each run of the proxy's calls, what the store held when that run
    was killed, and when the test first saw each line's result in the store."""

    def __init__(self, store: Path, engine_log: Path) -> None:
        self.store = store
        self.engine = RequestLogReader(engine_log)
        self.batch_id = ""
        self.seen_recorded: dict[str, float] = {}  # custom_id -> epoch seconds
        self.runs: list[list[LoggedRequest]] = [[]]
        self.held_at_end: list[set[str]] = []  # of each run, once its proxy is gone
        self._next_look = 0.0

    def look(self) -> None:
        """Read the store, then the engine's new calls: none may have reached the
        engine after the store was seen holding its line's result."""
        if self.batch_id:
            ids = recorded(self.store, self.batch_id)
            now = time.time()  # after the read: not before any of these was recorded
            for custom_id in ids:
                self.seen_recorded.setdefault(custom_id, now)
        for call in self.engine.read():
            assert call.user is not None, call
            self.runs[-1].append(call)
            seen = self.seen_recorded.get(call.user)
            assert seen is None or call.started < seen, (
                f"{call.user} reached the engine {call.started - seen:.3f} s after the "
                "store held its result"
            )

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, "condition not met"
            if time.monotonic() >= self._next_look:
                self.look()
                self._next_look = time.monotonic() + 0.05
            time.sleep(0.005)

    def run_ended(self) -> None:
        """The proxy is gone: wait until the engine has ended every call it had from
        it (aborted at the kill) and has had no new one for 0.2 s; note what the
        store holds. The calls read from now on are the next run's."""
        deadline = time.monotonic() + 10
        quiet_since = time.monotonic()
        while self.engine.running() or time.monotonic() - quiet_since < 0.2:
            assert time.monotonic() < deadline, f"the engine still runs {self.engine.running()}"
            count = len(self.engine.requests)
            self.look()
            if len(self.engine.requests) != count or self.engine.running():
                quiet_since = time.monotonic()
            time.sleep(0.01)
        self.held_at_end.append(recorded(self.store, self.batch_id))
        self.runs.append([])


def engine_calls_per_kill(witness: Witness) -> list[int]:
    """Check what each run sent against what the store held around it; the calls
    each run made that its kill lost (to be sent again)."""
    calls_of: Counter[str] = Counter()  # custom_id -> calls at the engine
    lost_of: Counter[str] = Counter()  # custom_id -> kills that caught it unrecorded
    held_before: set[str] = set()
    lost_per_run = []
    for run, held in enumerate(witness.held_at_end):
        sent = Counter(call.user for call in witness.runs[run] if call.user is not None)
        twice = sorted(c for c, n in sent.items() if n > 1)
        assert not twice, f"run {run} sent these lines more than once: {twice[:5]}"
        again = sorted(set(sent) & held_before)
        assert not again, f"run {run} sent lines recorded before it began: {again[:5]}"
        lost = set(sent) - held
        assert len(lost) <= WINDOW, f"run {run}: {len(lost)} calls lost, more than in flight"
        lost_per_run.append(len(lost))
        calls_of.update(sent)
        lost_of.update(lost)
        held_before = held
    assert lost_per_run[-1] == 0  # the last run ended with every line recorded
    over = {c: (n, lost_of[c]) for c, n in calls_of.items() if n > 1 + lost_of[c]}
    assert not over, f"sent more often than once plus once per kill in flight: {over}"
    return lost_per_run[:-1]


@contextmanager
def serving(tmp: Path, sim: Process, store: Path) -> Iterator[httpx.Client]:
    port = free_port()
    command = serve_command(
        tmp / "proxy.yaml",
        port=port,
        engines=[engine(sim.base_url, "sim-0")],
        batch_store_path=str(store),
        batch_retry_backoff_s=0.01,
        batch_window=WINDOW,
    )
    with running(command, stop_signal=signal.SIGKILL, grace_s=5) as process:
        base = loopback_url(port)
        # Up (built, store open), not necessarily ready: the job may keep the engine busy.
        wait_until_ok(base + "/healthz", process=process, what="the proxy", timeout_s=30)
        with httpx.Client(base_url=base, timeout=10) as http:
            yield http


@pytest.mark.timeout(150)
def test_sigkills_at_random_points_lose_and_repeat_nothing(tmp_path: Path) -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    store = tmp_path / "batch.db"
    engine_log = tmp_path / "engine.jsonl"
    witness = Witness(store, engine_log)
    wait = witness.wait
    with spawn_sim("--request-log", str(engine_log), time_scale=50.0) as sim:
        with serving(tmp_path, sim, store) as http:
            up = http.post("/v1/files", files={"file": ("in.jsonl", job_lines())},
                           data={"purpose": "batch"})  # fmt: skip
            assert up.status_code == 200, up.text
            ask = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
            made = http.post("/v1/batches", json={"input_file_id": up.json()["id"], **ask})
            assert made.status_code == 200, made.text
            batch_id = witness.batch_id = made.json()["id"]
            # The obstacle for the third kill (see the module docstring).
            Path(f"{store}.files/file-{batch_id}-output.tmp").mkdir()
            at = rng.randrange(30, 150)
            wait(lambda: status(store, batch_id)[1] >= at)
        witness.run_ended()
        kills = [(status(store, batch_id), seed)]
        with serving(tmp_path, sim, store):
            at = rng.randrange(kills[0][0][1] + 30, 400)
            wait(lambda: status(store, batch_id)[1] >= at)
        witness.run_ended()
        kills.append((status(store, batch_id), seed))
        with serving(tmp_path, sim, store):
            wait(lambda: status(store, batch_id)[0] == "finalizing")
            time.sleep(rng.uniform(0, 0.5))
        witness.run_ended()
        kills.append((status(store, batch_id), seed))
        Path(f"{store}.files/file-{batch_id}-output.tmp").rmdir()
        with serving(tmp_path, sim, store) as http:
            wait(lambda: status(store, batch_id)[0] == "completed")
            done = http.get(f"/v1/batches/{batch_id}").json()
            output = http.get(f"/v1/files/{done['output_file_id']}/content").text
            errors = http.get(f"/v1/files/{done['error_file_id']}/content").text
        witness.run_ended()
    assert [k[0][0] for k in kills] == ["in_progress", "in_progress", "finalizing"], kills
    assert kills[0][0][1] < kills[1][0][1] < LINES, kills
    ids = [json.loads(x)["custom_id"] for x in (output + errors).splitlines()]
    assert sorted(ids) == sorted(f"line-{i}" for i in range(LINES)), f"seed {seed}"
    counts = done["request_counts"]
    assert counts["total"] == LINES == counts["completed"] + counts["failed"]
    assert counts["completed"] == len(output.splitlines())
    lost = engine_calls_per_kill(witness)
    answered = {json.loads(x)["custom_id"] for x in output.splitlines()}
    called = {call.user for call in witness.engine.requests}
    assert answered <= called, f"answered with no engine call: {sorted(answered - called)[:5]}"
    print(
        f"seed {seed}: killed at {[k[0] for k in kills]}; {counts}; "
        f"{len(witness.engine.requests)} engine calls, lost per kill {lost}"
    )
