"""The overhead benchmark's ``vllm-router`` arm: vLLM's Rust router, from its own venv.

The router is installed into ``.venv-router`` (``make bench`` builds it from
``loadtests/bench/router-requirements.txt``), apart from the proxy's venv, as ``vllm-router``
is a program under test and not a dependency. It runs as one process in front of the
benchmark's upstream with flags that make it a plain relay, so that what it costs is
its relay and not a policy: see :func:`router_command`.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loadtests.support.processes import free_port, loopback_url, running, wait_until_ok

ROUTER_VENV = Path(__file__).resolve().parents[2] / ".venv-router"
# Its own default for both limits; set explicitly so that a level of the bench can
# never be queued or refused by them (the largest level is 1,024 streams).
MIN_CONCURRENCY = 32768
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
WARNING = re.compile(r"\b(WARN|ERROR)\b")


def router_binary(venv: Path = ROUTER_VENV) -> Path | None:
    """The ``vllm-router`` console script in ``venv``, or None when the venv is not
    built (the arm is then skipped)."""
    binary = venv / "bin" / "vllm-router"
    return binary if binary.is_file() else None


def router_command(
    binary: Path, upstream_url: str, port: int, metrics_port: int, max_streams: int
) -> list[str]:
    """The command line of the arm. Why each flag:

    - ``--policy round_robin``: the cheapest policy (one worker, so all policies route
      alike; the default ``cache_aware`` would add a prefix tree per request);
    - ``--max-concurrent-requests`` and ``--rate-limit-tokens-per-second``: at least
      the largest level, so the router's limiter neither queues nor refuses a stream;
    - ``--disable-retries``, ``--disable-circuit-breaker``: a failed request is
      counted as an error, as on the other arms, not retried or multiplied;
    - ``--prometheus-port``: a free port (its default is fixed, and two runs at once
      would collide);
    - ``--worker-startup-check-interval 1``: if the first health check of the
      upstream misses, the next is 1 s later, not 30;
    - ``--log-level warning``: as the proxy's arm, no line per request.
    """
    limit = str(max(MIN_CONCURRENCY, max_streams))
    return [
        str(binary),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", upstream_url,
        "--policy", "round_robin",
        "--max-concurrent-requests", limit,
        "--rate-limit-tokens-per-second", limit,
        "--disable-retries",
        "--disable-circuit-breaker",
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--worker-startup-check-interval", "1",
        "--log-level", "warning",
    ]  # fmt: skip


@contextmanager
def vllm_router(
    binary: Path, upstream: int, root: Path, max_streams: int
) -> Iterator[tuple[str, int]]:
    """The router in front of the upstream on loopback ``upstream``, as a child
    process, once it answers ``/health`` (it starts serving only after its worker
    has answered its health check); its base URL (``/v1``) and pid."""
    port = free_port()
    command = router_command(binary, loopback_url(upstream), port, free_port(), max_streams)
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "vllm-router.log"
    try:
        with (
            log_path.open("wb") as log,
            running(command, output=log, stop_signal=signal.SIGTERM, grace_s=5) as proc,
        ):
            wait_until_ok(loopback_url(port) + "/health", process=proc, what="vllm-router")
            yield loopback_url(port) + "/v1", proc.pid
    finally:
        for line in router_warnings(log_path):
            print(f"  vllm-router log: {line}", file=sys.stderr)


def router_warnings(path: Path, limit: int = 10) -> list[str]:
    """The router's warnings and errors (why requests failed, when some did), without
    colour codes: the first ``limit`` and a count of the rest. The one it always
    logs when stopped (its queue processor shutting down) is left out."""
    if not path.exists():
        return []
    lines = [ANSI_ESCAPE.sub("", x) for x in path.read_text(errors="replace").splitlines()]
    lines = [x for x in lines if WARNING.search(x) and "shutting down" not in x]
    more = [f"... {len(lines) - limit} more warnings"] if len(lines) > limit else []
    return lines[:limit] + more
