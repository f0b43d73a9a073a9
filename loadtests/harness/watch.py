"""What the servers did during a run, seen from outside them: their ``/metrics``
scraped about every second into the result directory, and the operating system's
view of each server's processes (resident and swapped memory, CPU) with
:mod:`psutil`, plus the GPUs' memory and power from ``nvidia-smi`` when it is there.

The runtime's own numbers can hide what the machine does (an engine that pages
memory or falls back to a slow kernel keeps answering), so the OS counters are kept
beside them. A server is a base URL and, when it runs on this machine, the process
that listens on its port (found with :func:`listening_pid`); its children count with
it (vLLM's engine core and workers).

Files: ``metrics/<arm>-<server>.prom`` (each scrape, headed ``# scraped_at T``, T
seconds from the watch's start) and ``os-<arm>.jsonl`` (one sample a line).
:func:`peaks` reduces the samples to each server's peaks and the GPUs' energy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

INTERVAL_S = 1.0
NVIDIA_QUERY = "memory.used,power.draw"


def listening_pid(url: str) -> int | None:
    """The process that listens on ``url``'s port on this machine, or None."""
    try:
        import psutil  # a bench dependency (dev extras), imported where it is used
    except ImportError:  # the image has no dev extras: no OS view, the run goes on
        return None
    port = urlsplit(url).port
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return conn.pid
    return None


class ProcessView:
    """The OS view of processes, kept from one sample to the next (psutil measures a
    process's CPU since the previous call on the same object)."""

    def __init__(self) -> None:
        self._procs: dict[int, Any] = {}  # pid: psutil.Process

    def sample(self, pid: int) -> dict[str, float] | None:
        """``pid`` and its children now: summed RSS and swap (bytes), CPU (percent of
        one core since the last sample), how many processes; None if it is gone."""
        import psutil

        try:
            root = self._procs.setdefault(pid, psutil.Process(pid))
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        rss = swap = cpu = 0.0
        for found in procs:
            proc = self._procs.setdefault(found.pid, found)
            with contextlib.suppress(psutil.Error):
                info = proc.memory_full_info()
                rss += info.rss
                swap += getattr(info, "swap", 0.0)
                cpu += proc.cpu_percent(None)
        return {"rss_bytes": rss, "swap_bytes": swap, "cpu_percent": cpu, "processes": len(procs)}


def gpu_sample() -> list[dict[str, float]] | None:
    """Each GPU's memory used (MiB) and power draw (W) from ``nvidia-smi``; None
    without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={NVIDIA_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        memory, power = (x.strip() for x in line.split(","))
        with contextlib.suppress(ValueError):
            gpus.append({"memory_mib": float(memory), "power_w": float(power)})
    return gpus


def energy_joules(times: Sequence[float], watts: Sequence[float]) -> float:
    """The energy of a power series (trapezoids between samples), joules."""
    return sum(
        (t1 - t0) * (w0 + w1) / 2
        for t0, t1, w0, w1 in zip(times, times[1:], watts, watts[1:], strict=False)
    )


def peaks(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each server's peak RSS, swap and CPU over ``samples``; with GPUs, their peak
    memory and power and the energy over the samples' span (summed over GPUs)."""
    servers: dict[str, dict[str, float]] = {}
    for sample in samples:
        for name, proc in sample.get("servers", {}).items():
            if proc is None:
                continue
            peak = servers.setdefault(
                name, {"rss_peak_bytes": 0.0, "swap_peak_bytes": 0.0, "cpu_peak_percent": 0.0}
            )
            peak["rss_peak_bytes"] = max(peak["rss_peak_bytes"], proc["rss_bytes"])
            peak["swap_peak_bytes"] = max(peak["swap_peak_bytes"], proc["swap_bytes"])
            peak["cpu_peak_percent"] = max(peak["cpu_peak_percent"], proc["cpu_percent"])
    out: dict[str, Any] = {"servers": servers, "gpu": None}
    with_gpu = [s for s in samples if s.get("gpus")]
    if with_gpu:
        times = [s["t"] for s in with_gpu]
        power = [sum(g["power_w"] for g in s["gpus"]) for s in with_gpu]
        out["gpu"] = {
            "memory_peak_mib": max(sum(g["memory_mib"] for g in s["gpus"]) for s in with_gpu),
            "power_peak_w": max(power),
            "energy_j": energy_joules(times, power),
            "seconds": times[-1] - times[0],
        }
    return out


@contextlib.asynccontextmanager
async def in_background(work: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Run ``work`` as a task while the body runs; cancel it and wait for it after."""
    task = asyncio.create_task(work)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def watching(
    http: httpx.AsyncClient,
    servers: dict[str, str],
    pids: dict[str, int | None],
    out: Path,
    arm: str,
    samples: list[dict[str, Any]],
    interval_s: float = INTERVAL_S,
) -> AsyncIterator[float]:
    """While the body runs: every ``interval_s``, scrape each server's ``/metrics``
    (``servers``: name to base URL) into ``out/metrics/<arm>-<name>.prom``, and sample
    each server's processes (``pids``: name to the pid listening, None for one not on
    this machine) and the GPUs into ``samples`` and ``out/os-<arm>.jsonl``. Yields the
    watch's start (monotonic seconds), from which the files' times count."""
    (out / "metrics").mkdir(exist_ok=True)
    start = time.monotonic()
    view = ProcessView()

    async def scrape(name: str, url: str, t: float) -> None:
        try:
            text = (await http.get(f"{url}/metrics", timeout=5)).text
        except httpx.HTTPError:
            return  # a missed scrape is a gap, not a failure of the run
        with (out / "metrics" / f"{arm}-{name}.prom").open("a") as f:
            f.write(f"# scraped_at {t:.3f}\n{text}")

    async def loop() -> None:
        with (out / f"os-{arm}.jsonl").open("a") as log:
            while True:
                t = time.monotonic() - start
                await asyncio.gather(*(scrape(n, u, t) for n, u in servers.items()))
                sample = await asyncio.to_thread(_sample, view, t, pids)
                samples.append(sample)
                log.write(json.dumps(sample) + "\n")
                log.flush()
                await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - start - t)))

    async with in_background(loop()):
        yield start


def _sample(view: ProcessView, t: float, pids: dict[str, int | None]) -> dict[str, Any]:
    return {
        "t": round(t, 3),
        "servers": {n: view.sample(p) if p else None for n, p in pids.items()},
        "gpus": gpu_sample(),
    }
