"""What piecing costs batch on an idle engine: ``python -m loadtests.bench.piecing``.
Prints numbers; it is not a test.

For each arm (``--modes``: ``piecing: off``, then ``on`` and ``auto`` by default) a
fresh simulated engine (a child
process, default flags: chunked prefill in 2,048-token steps, no long-prefill
threshold, prefix caching on) and a fresh ``whoseturn serve`` in front of it run
``--records`` batch requests (``/batch/v1/completions``) of ``--tokens`` prompt
tokens each, ``--concurrency`` at a time, and no chat at all. Records per hour of
each arm and its ratio to ``off`` (whole prompts) are printed, with the pieces sent.
``auto``, the default setting, pieces only after chat missed its aim on the engine,
so on an idle engine it should send none and cost nothing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from loadtests.engine_io import samples
from loadtests.support import processes

MODEL = "tiny"


def prompt(n: int, tokens: int) -> str:
    """Words of their own (one token each), so no two prompts share a prefix."""
    return " ".join(f"b{n}w{i}" for i in range(tokens))


async def run_records(url: str, records: int, tokens: int, concurrency: int) -> float:
    """Seconds to answer every record."""
    room = anyio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)

    async def one(client: httpx.AsyncClient, n: int) -> None:
        async with room:
            body = {"model": MODEL, "prompt": prompt(n, tokens), "max_tokens": 16}
            response = await client.post("/batch/v1/completions", json=body)
            response.raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for n in range(records):
                group.start_soon(one, client, n)
        return time.perf_counter() - start


def arm(folder: Path, piecing: str, args: argparse.Namespace) -> tuple[float, float]:
    """Records per hour with ``piecing``, and the pieces the proxy sent."""
    sim_port, port = processes.free_port(), processes.free_port()
    sim_url, url = processes.loopback_url(sim_port), processes.loopback_url(port)
    sim = processes.whoseturn_command(
        "sim", "--profile", "cpu-tiny", "--served-model-name", MODEL,
        "--time-scale", str(args.time_scale), "--port", str(sim_port),
    )  # fmt: skip
    engine = {"url": sim_url, "name": "sim", "models": [MODEL], "piecing": piecing}
    serve = processes.serve_command(
        folder / f"{piecing}.yaml", port=port, engines=[engine], ttft_target_s=args.ttft_target
    )
    with processes.running(sim), processes.running(serve) as proxy:
        processes.wait_until_ok(sim_url + "/health", timeout_s=30)
        processes.wait_until_ok(url + "/readyz", process=proxy, timeout_s=30)
        seconds = anyio.run(run_records, url, args.records, args.tokens, args.concurrency)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    pieces = samples(metrics).get("whoseturn_prefill_pieces_total", 0.0)
    return args.records * 3600 / seconds, pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument(
        "--ttft-target",
        type=float,
        default=0.3,
        help="the proxy's ttft_target_s: two pieces in the engine should take about "
        "this long (times the aim), so it sets the piece size when no chat streams",
    )
    parser.add_argument(
        "--modes",
        default="on,auto",
        help="the piecing settings to run after off (whole prompts), comma-separated",
    )
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m and m != "off"]
    with tempfile.TemporaryDirectory() as tmp:
        whole, _ = arm(Path(tmp), "off", args)
        runs = {mode: arm(Path(tmp), mode, args) for mode in modes}
    print(
        f"{args.records} records of {args.tokens} prompt tokens, {args.concurrency} at a time, "
        f"sim time scale {args.time_scale:g}, ttft_target_s {args.ttft_target:g}, no chat"
    )
    print(f"piecing off (whole prompts): {whole:,.0f} records/hour")
    for mode, (rate, pieces) in runs.items():
        print(
            f"piecing {mode}: {rate:,.0f} records/hour ({pieces:.0f} pieces), "
            f"ratio to off {rate / whole:.3f}"
        )


if __name__ == "__main__":
    main()
