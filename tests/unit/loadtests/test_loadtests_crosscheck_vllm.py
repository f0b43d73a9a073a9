"""The cross-check against vllm bench serve (loadtests.compare.crosscheck_vllm): the dataset it
reads, its command, its send times replayed by the harness, the figures read from its
result JSON and the table. No network, no vLLM."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtests.compare.crosscheck_vllm import (
    bench_argv,
    bench_env,
    bench_figures,
    harness_workload,
    interpolated,
    main,
    send_times,
    traffic_class,
    write_dataset,
)
from loadtests.harness import traffic
from loadtests.harness.workload_file import Arrival, load_workload, parse_workload

WORKLOAD = Path(__file__).parents[3] / "loadtests" / "workloads" / "crosscheck-vllm.yaml"


def test_dataset_is_the_harness_requests(tmp_path: Path) -> None:
    workload = load_workload(WORKLOAD)
    cls = traffic_class(workload, "chat")
    out = tmp_path / "d.jsonl"
    write_dataset(workload, cls, 5, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    sent = [traffic.body(workload, cls, i)["messages"] for i in range(5)]
    assert [[{"role": "user", "content": r["prompt"]}] for r in rows] == sent
    assert {r["output_tokens"] for r in rows} == {32}
    assert len({r["prompt"] for r in rows}) == 5


def test_dataset_refuses_a_conversation(tmp_path: Path) -> None:
    data = yaml.safe_load(WORKLOAD.read_text())
    data["classes"]["chat"]["prompt"] = {"source": "conversations"}
    workload = parse_workload(data, base=WORKLOAD.parent)
    with pytest.raises(ValueError, match="one user message"):
        write_dataset(workload, workload.classes[0], 3, tmp_path / "d.jsonl")


def test_bench_command_matches_the_class(tmp_path: Path) -> None:
    workload = load_workload(WORKLOAD)
    cls = traffic_class(workload, "chat")
    argv_for = functools.partial(
        bench_argv,
        python=Path("py"),
        base_url="http://e",
        tokenizer=Path("m"),
        workload=workload,
        dataset=tmp_path / "d.jsonl",
        result_dir=tmp_path,
    )
    argv = argv_for(cls=cls, n=40)
    pairs = dict(itertools.pairwise(argv))
    assert pairs["--backend"] == "openai-chat"
    assert pairs["--endpoint"] == "/v1/chat/completions"
    assert pairs["--request-rate"] == "0.3" and pairs["--burstiness"] == "1"
    assert pairs["--seed"] == "0" and pairs["--num-prompts"] == "40"
    assert pairs["--custom-output-len"] == "32" and pairs["--temperature"] == "0"
    for flag in ("--disable-shuffle", "--skip-chat-template", "--ignore-eos", "--save-detailed"):
        assert flag in argv
    closed = dataclasses.replace(cls, arrival=Arrival(process="closed", concurrency=2))
    with pytest.raises(ValueError, match="closed"):
        argv_for(cls=closed, n=1)


def test_bench_path_goes_to_the_bench_alone() -> None:
    assert "PYTHONPATH" not in bench_env({"PATH": "/bin"})
    env = bench_env({"WHOSETURN_VLLM_BENCH_PATH": "/x"})
    assert env["PYTHONPATH"] == "/x" and env["HF_HUB_OFFLINE"] == "1"


def test_the_harness_replays_the_send_times(tmp_path: Path) -> None:
    times = send_times({"start_times": [100.5, 100.0, 101.25]})
    assert times == [0.5, 0.0, 1.25]
    (tmp_path / "t.txt").write_text("".join(f"{t}\n" for t in times))
    raw = yaml.safe_load(WORKLOAD.read_text())
    derived = harness_workload(raw, "chat", "t.txt", 2.25)
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(derived))
    workload = load_workload(tmp_path / "w.yaml")
    (cls,) = workload.classes
    assert traffic.send_times(workload, cls) == [0.0, 0.5, 1.25]
    assert workload.plan.duration_s == 2.25 and workload.plan.warmup_s == 0
    assert [a.name for a in workload.arms] == ["direct"]
    assert workload.engines == load_workload(WORKLOAD).engines
    assert traffic.body(workload, cls, 3) == traffic.body(load_workload(WORKLOAD), cls, 3)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([1.0, 2.0, 3.0, 4.0], 0.5, 2.5), ([1.0, 2.0, 3.0, 4.0], 0.95, 3.85), ([7.0], 0.95, 7.0)],
)
def test_interpolated_is_numpys_linear_rule(values: list[float], q: float, expected: float) -> None:
    assert interpolated(values, q) == pytest.approx(expected)


def _bench(ttfts: list[float], errors: list[str]) -> dict[str, Any]:
    ok = [t for t, e in zip(ttfts, errors, strict=True) if not e]
    return {
        "completed": len(ok),
        "median_ttft_ms": interpolated(ok, 0.5) * 1000,
        "p95_ttft_ms": interpolated(ok, 0.95) * 1000,
        "median_tpot_ms": 5.0,
        "median_itl_ms": 4.0,
        "ttfts": ttfts,
        "errors": errors,
        "itls": [[0.005] * 31 if not e else [] for e in errors],
        "input_lens": [400 + i for i in range(len(ttfts))],
        "generated_texts": [f"answer {i}" for i in range(len(ttfts))],
        "start_times": [float(i) for i in range(len(ttfts))],
    }


def test_bench_figures_leave_out_failed_requests() -> None:
    ttfts = [0.1, 0.2, 0.0, 0.4]
    got = bench_figures(_bench(ttfts, ["", "", "timeout", ""]))
    assert got["completed"] == 3
    assert got["p50"] == pytest.approx(0.2) and got["p50_nearest_rank"] == pytest.approx(0.2)
    assert got["tpot_p50"] == pytest.approx(0.005) and got["itl_p50"] == pytest.approx(0.004)
    assert got["ttft"] == [0.1, 0.2, None, 0.4]
    assert got["chunks"] == [32, 32, 0, 32]


def _harness_dir(out: Path, ttfts: list[float], p50: float, p95: float) -> None:
    run = out / "harness" / "crosscheck-vllm-harness-2026-12-01-000000"
    run.mkdir(parents=True)
    summary = {
        "requests": len(ttfts),
        "valid": len(ttfts),
        "ttft_p50": p50,
        "ttft_p95": p95,
        "tpot_p50": 0.005,
        "itl_p50": 0.004,
    }
    (run / "result.json").write_text(json.dumps({"summaries": {"direct": {"chat": summary}}}))
    rows = [
        {
            "arm": "direct",
            "kind": "chat",
            "id": f"chat-{i}",
            "ttft": t,
            "token_times": [float(k) for k in range(32)],
            "prompt_tokens": 400 + i,
            "text": f"answer {i}",
        }
        for i, t in enumerate(ttfts)
    ]
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))


def test_compare_prints_the_table_and_judges_the_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ttfts = [0.1 * (i + 1) for i in range(20)]  # 0.1 .. 2.0 s
    (tmp_path / "vllm-bench.json").write_text(json.dumps(_bench(ttfts, [""] * 20)))
    # vllm bench's own: p50 1.05 s, p95 1.905 s; the harness's 1.0 s and 1.9 s
    _harness_dir(tmp_path, ttfts, p50=1.0, p95=1.9)
    assert main(["compare", str(tmp_path), "chat"]) == 0
    out = capsys.readouterr().out
    assert "| TTFT p50, own rule | 1,050.0 ms | 1,000.0 ms | +5.0% |" in out
    assert "| TTFT p50, nearest rank | 1,000.0 ms | 1,000.0 ms | +0.0% |" in out
    assert "20 / 20, 20 / 20" in out  # prompt tokens and answers paired by request index
    assert "Worst TTFT difference 5.0%" in out
    assert main(["compare", str(tmp_path), "chat", "--tolerance", "4"]) == 1
