"""Tenants in the harness: every request a tenant's class sends carries its key,
every record keeps its tenant, and the report's per-tenant rows (requests, TTFT,
tokens, share of tokens) are computed from the records the harness kept."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.harness.report import Findings, write_report, write_result
from loadtests.harness.report_sections import tenant_lines, tenant_table
from loadtests.harness.tenants import TenantSummary, summarize_tenants
from loadtests.harness.traffic import ArmRun, Job, count_output, new_run, proxy_route, run_arm
from loadtests.harness.workload_file import Workload, parse_workload
from tests.support.workloads import chat_class
from tests.unit.loadtests.records import record

Json = dict[str, Any]


def two_tenants(duration_s: float = 10.0, warmup_s: float = 2.0) -> Workload:
    """Tenants quiet (an open loop) and noisy (a closed loop), and a top-level class
    ``anon`` that sends no key."""
    quiet = chat_class({"process": "periodic", "rate": 20}, chars=100, max_tokens=2)
    noisy = chat_class({"process": "closed", "concurrency": 2}, chars=400, max_tokens=2)
    anon = chat_class({"process": "periodic", "rate": 10}, chars=100, max_tokens=2)
    return parse_workload(
        {
            "name": "t",
            "plan": {"duration_s": duration_s, "warmup_s": warmup_s},
            "classes": {"anon": anon},
            "tenants": [
                {"name": "quiet", "key": "k-quiet", "classes": {"chat": quiet}},
                {"name": "noisy", "key": "k-noisy", "classes": {"chat": noisy}},
            ],
        },
        base=Path(),
    )


# -- over HTTP: keys sent, tenants kept -------------------------------------------------


def sse(data: Json) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


class Proxy:
    """A fake proxy: answers each chat with two tokens and usage after a short
    service time, keeping each request's class (its prompt's header) and key."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        header = body["messages"][0]["content"].split("\n", 1)[0]
        self.seen.append((header.split(" ", 1)[0], request.headers.get("authorization")))
        await asyncio.sleep(0.01)  # the service time: a closed loop does not spin
        chunks = [
            sse({"choices": [{"index": 0, "delta": {"content": "a"}}]}),
            sse({"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}]}),
            sse({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2}}),
            b"data: [DONE]\n\n",
        ]
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=b"".join(chunks)
        )


@pytest.mark.anyio
async def test_every_request_carries_its_tenants_key_and_every_record_its_tenant() -> None:
    work = two_tenants(duration_s=0.4, warmup_s=0.0)
    proxy = Proxy()
    async with httpx.AsyncClient(transport=httpx.MockTransport(proxy)) as http:
        run = await run_arm(work, proxy_route("http://proxy"), http, new_run(work))
    keys = {"quiet/chat": "Bearer k-quiet", "noisy/chat": "Bearer k-noisy", "anon": None}
    assert {cls for cls, _ in proxy.seen} == set(keys)
    assert all(key == keys[cls] for cls, key in proxy.seen)
    assert {r.tenant for r in run.records["quiet/chat"]} == {"quiet"}
    assert {r.tenant for r in run.records["noisy/chat"]} == {"noisy"}
    assert {r.tenant for r in run.records["anon"]} == {""}
    assert len(run.records["quiet/chat"]) == 7  # every 0.05 s within 0.4 s, the first after one gap
    row = next(r for r in run.records["noisy/chat"] if r.closed_at is None).to_json()
    assert row["tenant"] == "noisy" and "k-noisy" not in json.dumps(row)


# -- the per-tenant figures -------------------------------------------------------------


def run_of(records: dict[str, list[Any]], jobs: dict[str, list[Job]] | None = None) -> ArmRun:
    return ArmRun(started_at=100.0, records=records, jobs=jobs or {})


def answered(
    n: int, kind: str, tenant: str, sent: float, ttft: float, prompt: int, completion: int
) -> Any:
    return record(
        n,
        kind=kind,
        tenant=tenant,
        sent_at=sent,
        token_times=[sent + ttft],
        finished_at=sent + ttft + 0.1,
        status=200,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


def test_a_tenants_row_counts_its_requests_after_warm_up_their_ttft_and_their_tokens() -> None:
    work = two_tenants()  # warm-up 2 s, window 102..110
    quiet = [
        answered(n, "quiet/chat", "quiet", 103.0 + n, 0.010 * (n + 1), 10, 2) for n in range(4)
    ]
    quiet.append(answered(9, "quiet/chat", "quiet", 100.5, 5.0, 1000, 1000))  # in the warm-up
    noisy = [answered(n, "noisy/chat", "noisy", 104.0, 0.5, 80, 4) for n in range(3)]
    noisy.append(record(7, kind="noisy/chat", tenant="noisy", sent_at=105.0, closed_at=110.0))
    rows = summarize_tenants(work, [run_of({"anon": [], "quiet/chat": quiet, "noisy/chat": noisy})])
    assert [r.tenant for r in rows] == ["", "quiet", "noisy"]
    anon, q, n = rows
    assert (anon.requests, anon.tokens, anon.share) == (0, 0, 0.0)
    assert math.isnan(anon.ttft_p50) and anon.label == "(no key)"
    assert (q.requests, q.tokens) == (4, 48)
    assert q.ttft_p50 == pytest.approx(0.020) and q.ttft_p95 == pytest.approx(0.040)
    assert (n.requests, n.tokens, n.ttft_p95) == (3, 252, 0.5)  # the closed stream left out
    assert q.share == pytest.approx(48 / 300) and n.share == pytest.approx(252 / 300)


def test_a_batch_api_jobs_lines_and_tokens_count_for_its_tenant() -> None:
    work = parse_workload(
        {
            "name": "t",
            "plan": {"duration_s": 10, "warmup_s": 2},
            "tenants": [
                {
                    "name": "jobs",
                    "key": "k1",
                    "classes": {
                        "j": {
                            "route": "batch-api",
                            "api": "chat",
                            "arrival": {"process": "closed", "concurrency": 1},
                            "prompt": {"chars": 100},
                            "max_tokens": 2,
                            "job_lines": 5,
                        }
                    },
                },
                {"name": "chat", "key": "k2", "classes": {"c": two_tenants_chat()}},
            ],
        },
        base=Path(),
    )
    output = "".join(
        json.dumps({"custom_id": f"j-{i}", "response": {"status_code": 200, "body": body}}) + "\n"
        for i, body in enumerate(
            [{"usage": {"prompt_tokens": 40, "completion_tokens": 2}}, {"usage": None}]
        )
    )
    assert count_output(output, 2).tokens == 42
    late = Job("j-0", "jobs/j", 5, 103.0, tokens=42, tenant="jobs")
    early = Job("j-1", "jobs/j", 5, 101.0, tokens=1000, tenant="jobs")
    run = run_of({"jobs/j": [], "chat/c": []}, {"jobs/j": [late, early]})
    jobs, chat = summarize_tenants(work, [run])
    assert (jobs.requests, jobs.tokens, jobs.share) == (5, 42, 1.0)
    assert math.isnan(jobs.ttft_p50) and chat.requests == 0


def two_tenants_chat() -> Json:
    return chat_class({"process": "poisson", "rate": 1}, chars=100, max_tokens=2)


# -- the report's rows ------------------------------------------------------------------


ROWS = [
    TenantSummary("quiet", 40, 0.011, 0.012, 1_000, 0.25),
    TenantSummary("noisy", 90, 0.321, 0.610, 3_000, 0.75),
]


def test_the_report_has_a_row_per_arm_and_tenant_with_more_than_one_tenant() -> None:
    text = tenant_table({"proxy": ROWS})
    lines = text.splitlines()
    assert lines[0] == (
        "| arm | tenant | requests | TTFT p50 | TTFT p95 | tokens | share of tokens |"
    )
    assert lines[2:] == [
        "| proxy | quiet | 40 | 11 ms | 12 ms | 1,000 | 25.0% |",
        "| proxy | noisy | 90 | 321 ms | 610 ms | 3,000 | 75.0% |",
    ]
    assert tenant_lines({"proxy": ROWS})[0] == "## Tenants"


def test_one_tenant_gets_no_tenant_rows() -> None:
    assert tenant_table({"proxy": ROWS[:1], "direct": ROWS[:1]}) == ""
    assert tenant_lines({}) == []


def test_report_and_result_carry_the_tenant_rows(tmp_path: Path) -> None:
    work = two_tenants()
    found = Findings(
        answers=None,
        verdicts=[],
        machine={},
        started={},
        stalls={},
        disturbed={},
        by_prompt={},
        engines={},
        tenants={"proxy": [*ROWS, TenantSummary("", 0, math.nan, math.nan, 0, 0.0)]},
    )
    write_report(tmp_path, work, found, intro="i", table="T", plots=[])
    report = (tmp_path / "report.md").read_text()
    assert "| proxy | noisy | 90 | 321 ms | 610 ms | 3,000 | 75.0% |" in report
    assert "| proxy | (no key) | 0 | - | - | 0 | 0.0% |" in report
    write_result(tmp_path, work, found, setup={}, summaries={}, reasoning="r")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["tenants"]["proxy"][1]["share"] == 0.75
    assert result["tenants"]["proxy"][2]["ttft_p50"] is None
    assert [t["name"] for t in result["workload"]["tenants"]] == ["quiet", "noisy"]
    assert "k-quiet" not in (tmp_path / "result.json").read_text()
