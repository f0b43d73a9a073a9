"""The harness against vLLM's own benchmark client on real vLLM: the same requests,
sent at the same moments to a fresh server of the same command, measured by
``vllm bench serve`` and by ``whoseturn loadtest`` (docs/crosscheck.md).

``python -m loadtests.compare.crosscheck_vllm run WORKLOAD.yaml CLASS --requests N --out DIR``:

1. writes the class's first ``N`` requests (:func:`loadtests.harness.traffic.body`) as vLLM's
   custom dataset (``DIR/dataset.jsonl``: ``prompt``, ``output_tokens``);
2. starts the workload's engine (``engines:``), runs ``vllm bench serve`` from the
   engine's interpreter on that dataset in file order, at the class's rate with the
   workload's seed (Poisson, or gamma with the class's burstiness), ``max_tokens``
   tokens with ``ignore_eos``, temperature 0, and stops the engine. Its result JSON
   (per request too, ``--save-detailed``) is ``DIR/vllm-bench.json``, its output
   ``DIR/vllm-bench.log``;
3. writes vllm bench's send times (``DIR/send-times.txt``) and a workload of that one
   class replaying them as a trace (``DIR/harness-workload.yaml``), and runs
   ``whoseturn loadtest`` on it: the harness starts a fresh engine of the same
   command, sends the same ``N`` requests in the same order at the same offsets;
   its result directory is ``DIR/harness/``;
4. prints the table of :func:`compare`.

``python -m loadtests.compare.crosscheck_vllm compare DIR CLASS`` prints the table again from
the kept outputs. Both exit 1 when vllm bench's TTFT p50 or p95 differs from the
harness's by more than ``--tolerance`` percent (10).

Each client's own figures are compared (vllm bench: numpy's interpolated
percentiles; the harness: nearest rank), and both rules over both clients'
per-request values beside them. Each client gets its own fresh server: prefix
caching is on by vLLM's default, so a second client on the same server would find
every prompt cached.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from loadtests.harness.engines import started
from loadtests.harness.measures import pct
from loadtests.harness.traffic import body
from loadtests.harness.workload_file import ArmSpec, TrafficClass, Workload, load_workload
from loadtests.support.markdown import markdown_table
from loadtests.support.vllm import model_dir, vllm_python

BENCH_RESULT = "vllm-bench.json"
SEND_TIMES = "send-times.txt"
HARNESS_WORKLOAD = "harness-workload.yaml"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
BACKENDS = {
    "chat": ("openai-chat", "/v1/chat/completions"),
    "completions": ("openai", "/v1/completions"),
}
"""The class's API: vllm bench's backend and endpoint."""

# vLLM's console script fails on the CPU build (it looks up the distribution "vllm");
# its benchmark's own parser and main, called from the engine's interpreter, work.
BENCH_MAIN = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = argparse.ArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def traffic_class(workload: Workload, name: str) -> TrafficClass:
    """The class ``name`` of ``workload``; :class:`ValueError` if it has none such."""
    for cls in workload.classes:
        if cls.name == name:
            return cls
    raise ValueError(f"{workload.name}: no class {name!r}")


def write_dataset(workload: Workload, cls: TrafficClass, n: int, out: Path) -> list[str]:
    """Write the first ``n`` requests of ``cls`` as vLLM's custom dataset (one
    ``{"prompt", "output_tokens"}`` a line, the lone user message's text for the chat
    API); the prompts. A request of several messages has no such form: ValueError."""
    prompts = []
    for i in range(n):
        b = body(workload, cls, i)
        if "prompt" in b:
            prompts.append(b["prompt"])
            continue
        chat = b["messages"]
        if len(chat) != 1 or chat[0]["role"] != "user":
            raise ValueError(f"{cls.name} {i}: not one user message; vllm bench sends one")
        prompts.append(chat[0]["content"])
    with out.open("w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt, "output_tokens": cls.max_tokens}) + "\n")
    return prompts


def bench_argv(
    *,
    python: Path,
    base_url: str,
    tokenizer: Path,
    workload: Workload,
    cls: TrafficClass,
    n: int,
    dataset: Path,
    result_dir: Path,
) -> list[str]:
    """``vllm bench serve``'s command for ``n`` requests of ``cls`` from ``dataset``
    (in file order, no chat template applied on the client: the server applies it, as
    for the harness's requests) at the class's rate, seeded with the workload's seed."""
    a = cls.arrival
    if a.process not in ("poisson", "gamma"):
        raise ValueError(f"{cls.name}: vllm bench sends at a rate; not {a.process} arrivals")
    backend, endpoint = BACKENDS[cls.api]
    return [
        str(python),
        "-c",
        BENCH_MAIN,
        *("--backend", backend, "--base-url", base_url, "--endpoint", endpoint),
        *("--model", workload.model, "--tokenizer", str(tokenizer)),
        *("--dataset-name", "custom", "--dataset-path", str(dataset)),
        *("--disable-shuffle", "--skip-chat-template", "--num-prompts", str(n)),
        *("--custom-output-len", str(cls.max_tokens), "--ignore-eos"),
        *("--temperature", f"{cls.temperature:g}", "--seed", str(workload.seed)),
        *("--request-rate", f"{a.rate:g}"),
        *("--burstiness", f"{1.0 if a.process == 'poisson' else a.burstiness:g}"),
        *("--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,95"),
        *("--save-result", "--save-detailed", "--disable-tqdm"),
        *("--result-dir", str(result_dir), "--result-filename", BENCH_RESULT),
    ]


def send_times(result: dict[str, Any]) -> list[float]:
    """vllm bench's send times (``start_times``, per request in dataset order) as
    seconds after its first."""
    starts = result["start_times"]
    first = min(starts)
    return [t - first for t in starts]


def harness_workload(
    raw: dict[str, Any], cls_name: str, times_file: str, duration_s: float
) -> dict[str, Any]:
    """The workload file's data (``raw``) cut to ``cls_name`` sent at the times in
    ``times_file`` (a trace, relative to the new file), one warm run of
    ``duration_s`` seconds with no warm-up, direct to the engine."""
    cls = dict(raw["classes"][cls_name])
    cls["arrival"] = {"process": "trace", "file": times_file}
    return {
        **raw,
        "name": f"{raw.get('name', 'workload')}-harness",
        "plan": {"cold": False, "warm_runs": 1, "duration_s": duration_s, "warmup_s": 0},
        "arms": ["direct"],
        "classes": {cls_name: cls},
    }


def interpolated(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) by linear interpolation between closest ranks
    (numpy's default, vllm bench's rule); NaN if none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def bench_figures(result: dict[str, Any]) -> dict[str, Any]:
    """vllm bench's figures (seconds): its own (``p50``, ``p95`` of TTFT, TPOT and ITL
    medians), nearest rank over its successful requests' TTFTs, and per request (in
    dataset order, None where it failed) the TTFT, prompt tokens, answer, chunks."""
    ok = [not e for e in result["errors"]]
    ttfts = [t for t, good in zip(result["ttfts"], ok, strict=True) if good]
    return {
        "completed": result["completed"],
        "p50": result["median_ttft_ms"] / 1000.0,
        "p95": result["p95_ttft_ms"] / 1000.0,
        "p50_nearest_rank": pct(ttfts, 0.50),
        "p95_nearest_rank": pct(ttfts, 0.95),
        "p50_interpolated": interpolated(ttfts, 0.50),
        "p95_interpolated": interpolated(ttfts, 0.95),
        "tpot_p50": result["median_tpot_ms"] / 1000.0,
        "itl_p50": result["median_itl_ms"] / 1000.0,
        "ttft": [t if good else None for t, good in zip(result["ttfts"], ok, strict=True)],
        "prompt_tokens": list(result["input_lens"]),
        "texts": list(result["generated_texts"]),
        "chunks": [
            len(itl) + 1 if good else 0 for itl, good in zip(result["itls"], ok, strict=True)
        ],
    }


def harness_figures(
    result: dict[str, Any], rows: list[dict[str, Any]], cls_name: str
) -> dict[str, Any]:
    """The harness's figures of ``cls_name`` (its direct arm; seconds): its own from
    ``result.json``, interpolated TTFT percentiles over its records, and per request
    (by its index in the class) the TTFT, prompt tokens, answer and token chunks."""
    s = result["summaries"]["direct"][cls_name]
    mine = sorted(
        (r for r in rows if r["kind"] == cls_name), key=lambda r: int(r["id"].rsplit("-", 1)[1])
    )
    ttfts = [r["ttft"] for r in mine if r["ttft"] is not None]
    return {
        "completed": s["valid"],
        "requests": s["requests"],
        "p50": s["ttft_p50"],
        "p95": s["ttft_p95"],
        "p50_nearest_rank": s["ttft_p50"],
        "p95_nearest_rank": s["ttft_p95"],
        "p50_interpolated": interpolated(ttfts, 0.50),
        "p95_interpolated": interpolated(ttfts, 0.95),
        "tpot_p50": s["tpot_p50"],
        "itl_p50": s["itl_p50"],
        "ttft": [r["ttft"] for r in mine],
        "prompt_tokens": [r["prompt_tokens"] for r in mine],
        "texts": [r["text"] for r in mine],
        "chunks": [len(r["token_times"]) for r in mine],
    }


def same(a: Sequence[Any], b: Sequence[Any]) -> tuple[int, int]:
    """``(equal, compared)`` over the pairs of ``a`` and ``b`` by position."""
    pairs = list(zip(a, b, strict=False))
    return sum(1 for x, y in pairs if x == y), len(pairs)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def _diff(bench: float, harness: float) -> float:
    """vllm bench's figure against the harness's, in percent of the harness's."""
    return (bench / harness - 1) * 100


def table(bench: dict[str, Any], harness: dict[str, Any]) -> tuple[str, float]:
    """The side-by-side table, and the worst difference of the two clients' own TTFT
    p50 and p95 (percent)."""
    rows: list[tuple[str, ...]] = [
        ("completed requests", str(bench["completed"]), str(harness["completed"]), "")
    ]
    for label, key in (
        ("TTFT p50, own rule", "p50"),
        ("TTFT p95, own rule", "p95"),
        ("TTFT p50, interpolated", "p50_interpolated"),
        ("TTFT p95, interpolated", "p95_interpolated"),
        ("TTFT p50, nearest rank", "p50_nearest_rank"),
        ("TTFT p95, nearest rank", "p95_nearest_rank"),
        ("TPOT p50, own rule", "tpot_p50"),
        ("ITL p50, own rule", "itl_p50"),
    ):
        b, h = bench[key], harness[key]
        rows.append((label, _ms(b), _ms(h), f"{_diff(b, h):+.1f}%"))
    tokens, pairs = same(bench["prompt_tokens"], harness["prompt_tokens"])
    answers, _ = same(bench["texts"], harness["texts"])
    chunks_b, chunks_h = (sum(x["chunks"]) / max(1, len(x["chunks"])) for x in (bench, harness))
    rows += [
        ("same prompt tokens, same answer", f"{tokens} / {pairs}, {answers} / {pairs}", "", ""),
        ("chunks per stream, mean", f"{chunks_b:.1f}", f"{chunks_h:.1f}", ""),
    ]
    header = ("", "vllm bench", "harness", "vllm bench vs harness")
    worst = max(abs(_diff(bench[q], harness[q])) for q in ("p50", "p95"))
    return markdown_table(header, rows), worst


def compare(out: Path, cls_name: str, tolerance: float) -> int:
    """Print the table from ``out``'s kept outputs; 1 if the worst own-rule TTFT
    difference is over ``tolerance`` percent."""
    bench = bench_figures(json.loads((out / BENCH_RESULT).read_text()))
    (result_dir,) = sorted((out / "harness").glob("*/result.json"))
    records = (result_dir.parent / "records.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in records if line.strip()]
    harness = harness_figures(json.loads(result_dir.read_text()), rows, cls_name)
    text, worst = table(bench, harness)
    print(text)
    print(f"\nWorst TTFT difference {worst:.1f}% (tolerance {tolerance:g}%).")
    return 0 if worst <= tolerance else 1


def bench_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """vllm bench's environment: offline, and ``$WHOSETURN_VLLM_BENCH_PATH`` (a folder
    holding pandas, which its custom dataset reads with, for a ``.venv-vllm`` built
    before e2e/requirements.txt named it) as its ``PYTHONPATH``, for it alone."""
    env = {**(os.environ if environ is None else environ), **OFFLINE}
    if env.get("WHOSETURN_VLLM_BENCH_PATH"):
        env["PYTHONPATH"] = env["WHOSETURN_VLLM_BENCH_PATH"]
    return env


def loadavg() -> str:
    """The machine's load averages now (``/proc/loadavg``'s first three fields)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(workload_path: Path, cls_name: str, n: int, out: Path, tolerance: float) -> int:
    """Both clients in turn, each on a fresh engine (see the module docstring)."""
    workload = load_workload(workload_path)
    cls = traffic_class(workload, cls_name)
    if workload.engines is None:
        raise ValueError(f"{workload_path}: names no engines (engines:)")
    out.mkdir(parents=True)
    out = out.resolve()
    load = {"start": loadavg()}
    write_dataset(workload, cls, n, out / "dataset.jsonl")
    with started(out, ArmSpec(name="vllm-bench", via="direct"), workload) as servers:
        argv = bench_argv(
            python=vllm_python(),
            base_url=servers.engines[0].url,
            tokenizer=model_dir(),
            workload=workload,
            cls=cls,
            n=n,
            dataset=out / "dataset.jsonl",
            result_dir=out,
        )
        load["vllm bench start"] = loadavg()
        with (out / "vllm-bench.log").open("wb") as log:
            subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=bench_env(), check=True)
        load["vllm bench end"] = loadavg()
    times = send_times(json.loads((out / BENCH_RESULT).read_text()))
    (out / SEND_TIMES).write_text("".join(f"{t:.6f}\n" for t in times))
    raw = yaml.safe_load(workload_path.read_text())
    derived = harness_workload(raw, cls_name, SEND_TIMES, round(max(times) + 1.0, 3))
    (out / HARNESS_WORKLOAD).write_text(yaml.safe_dump(derived, sort_keys=False))
    load["harness start"] = loadavg()
    command = [sys.executable, "-m", "proxy", "loadtest", str(out / HARNESS_WORKLOAD)]
    reasoning = "cross-check against vllm bench serve: the same requests at its send times"
    subprocess.run([*command, "--out", str(out / "harness"), "--reasoning", reasoning], check=True)
    load["harness end"] = loadavg()
    (out / "load.json").write_text(json.dumps(load, indent=1) + "\n")
    print("Load averages (1, 5, 15 min): " + "; ".join(f"{k} {v}" for k, v in load.items()))
    return compare(out, cls_name, tolerance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.compare.crosscheck_vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="vllm bench serve, then the harness, each on a fresh engine")
    r.add_argument("workload", type=Path)
    r.add_argument("cls")
    r.add_argument("--requests", type=int, default=30)
    r.add_argument("--out", type=Path, required=True, help="a new directory")
    c = sub.add_parser("compare", help="the table again from a run's directory")
    c.add_argument("out", type=Path)
    c.add_argument("cls")
    for p in (r, c):
        p.add_argument("--tolerance", type=float, default=10.0, help="percent")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.workload, args.cls, args.requests, args.out, args.tolerance)
    return compare(args.out, args.cls, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
