"""Real vLLM servers (the CPU build) for the e2e tier, started as tests need them.

:class:`VllmFleet` starts ``python -m vllm.entrypoints.openai.api_server`` from
``.venv-vllm`` with the small model that ``e2e/build_tiny_model.py`` builds (both made
by ``make test-e2e``), one server per set of extra flags, on a free loopback port. A
server is ready once ``/health`` answers 200 (up to ``READY_TIMEOUT_S``: the first
start on a machine compiles; later ones reuse vLLM's cache). Each server writes its
log to ``artifacts/e2e/``. At most ``max_alive`` servers run at once (two cores): a
new one stops the least recently used. :meth:`VllmServer.stop` sends ``SIGTERM`` to
the server's process group (the API server, its engine core and worker), then
``SIGKILL`` after ``STOP_TIMEOUT_S``.

:func:`proxy_in_front` serves the proxy in front of running servers. Tests talk to the
servers over HTTP only; nothing here imports vllm or torch.
Environment: ``WHOSETURN_E2E_VLLM_PYTHON`` (default ``.venv-vllm/bin/python``),
``WHOSETURN_E2E_MODEL`` (default ``.cache/tiny-model``),
``WHOSETURN_E2E_READY_TIMEOUT_S`` (default 180).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from integration.proxyserver import ProxyServer, engine, free_port, run_proxy
from integration.simserver import MODEL, Served

REPO = Path(__file__).resolve().parents[2]
LOG_DIR = REPO / "artifacts" / "e2e"
READY_TIMEOUT_S = float(os.environ.get("WHOSETURN_E2E_READY_TIMEOUT_S", "180"))
STOP_TIMEOUT_S = 30.0
# A test that may start a server gets this much time on top of its own.
STARTUP_ALLOWANCE_S = READY_TIMEOUT_S + STOP_TIMEOUT_S
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
BASE_FLAGS = ("--served-model-name", MODEL, "--dtype", "bfloat16", "--max-model-len", "8192")
# The proxy scrapes a real engine's /metrics less often than a simulated one's: each
# scrape costs the engine's API server CPU time on two shared cores.
PROXY_OPTIONS: dict[str, Any] = {"scrape_interval_s": 0.5, "health_interval_s": 1.0}
_PR_SET_PDEATHSIG = 1


class VllmNotBuilt(RuntimeError):
    """``.venv-vllm`` or the model is missing: ``make test-e2e`` builds both."""


def _from_env(name: str, default: str) -> Path:
    path = Path(os.environ.get(name) or default)
    return path if path.is_absolute() else REPO / path


def vllm_python() -> Path:
    return _from_env("WHOSETURN_E2E_VLLM_PYTHON", ".venv-vllm/bin/python")


def model_dir() -> Path:
    return _from_env("WHOSETURN_E2E_MODEL", ".cache/tiny-model")


@dataclass
class VllmServer(Served):
    """One running vLLM API server; ``ready_after_s`` is how long it took to start."""

    flags: tuple[str, ...]
    process: subprocess.Popen[bytes]
    log_path: Path
    ready_after_s: float

    def running(self) -> float:
        """``vllm:num_requests_running``, summed over the engine's label sets."""
        return self.metric("vllm:num_requests_running")

    def stop(self) -> None:
        """``SIGTERM`` the process group, ``SIGKILL`` what is left after the grace."""
        self.http.close()
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait(10)
        _signal_group(self.process, signal.SIGKILL)  # orphaned children, if any


@dataclass
class VllmFleet:
    """The session's vLLM servers, one per tuple of extra flags, started on demand."""

    max_alive: int = 1
    starts: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    _alive: OrderedDict[tuple[str, ...], VllmServer] = field(default_factory=OrderedDict)

    def get(self, *flags: str) -> VllmServer:
        """A ready server started with ``flags`` (``--scheduling-policy priority`` ...)."""
        if flags in self._alive:
            self._alive.move_to_end(flags)
            server = self._alive[flags]
            if server.process.poll() is None:
                return server
            del self._alive[flags]
        while len(self._alive) >= self.max_alive:
            _, oldest = self._alive.popitem(last=False)
            oldest.stop()
        server = start_vllm(flags, index=len(self.starts))
        self.starts.append((flags, server.ready_after_s))
        self._alive[flags] = server
        return server

    def stop_all(self) -> None:
        while self._alive:
            _, server = self._alive.popitem()
            server.stop()


def start_vllm(flags: tuple[str, ...], *, index: int = 0) -> VllmServer:
    """Start one server and wait until it is ready; raises with its log's tail if it
    exits or is not ready within ``READY_TIMEOUT_S``."""
    python, model = vllm_python(), model_dir()
    if not python.exists() or not (model / "config.json").exists():
        raise VllmNotBuilt(f"need {python} and {model}: run `make test-e2e`")
    port = free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", " ".join(flags).lower()).strip("-") or "default"
    log_path = LOG_DIR / f"vllm-{index:02d}-{slug}.log"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += [*BASE_FLAGS, "--host", "127.0.0.1", "--port", str(port), *flags]
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENGINE_ENV},
            cwd=REPO,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    atexit.register(_kill_if_running, process)
    base_url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base_url, timeout=30)
    server = VllmServer(
        base_url=base_url,
        port=port,
        http=http,
        flags=flags,
        process=process,
        log_path=log_path,
        ready_after_s=0.0,
    )
    try:
        _wait_healthy(server)
    except BaseException:
        server.stop()
        raise
    server.ready_after_s = time.monotonic() - started
    return server


def _wait_healthy(server: VllmServer) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"vLLM exited ({server.process.returncode}) before it was ready; "
                f"{server.log_path}:\n{_tail(server.log_path)}"
            )
        with contextlib.suppress(httpx.TransportError):
            if server.http.get("/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(
        f"vLLM not ready within {READY_TIMEOUT_S:.0f} s; {server.log_path}:\n"
        f"{_tail(server.log_path)}"
    )


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _kill_if_running(process: subprocess.Popen[bytes]) -> None:
    """At exit, for a server that no teardown stopped."""
    if process.poll() is None:
        _signal_group(process, signal.SIGKILL)


def _die_with_parent() -> None:
    """In the child: ``SIGTERM`` the server if the test process dies without teardown."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@contextmanager
def proxy_in_front(*servers: VllmServer, **options: Any) -> Iterator[ProxyServer]:
    """The proxy (in this process, on a loopback socket) in front of ``servers``,
    named ``vllm-0``, ``vllm-1``, ...; ``options`` are top-level proxy settings.

    An engine started with ``--scheduling-policy priority`` is declared so, so that
    the proxy sends each request's priority.
    """
    engines = [
        engine(server.base_url, f"vllm-{i}", scheduling_policy=_policy(server.flags))
        for i, server in enumerate(servers)
    ]
    with run_proxy(engines, **{**PROXY_OPTIONS, **options}) as proxy:
        yield proxy


def _policy(flags: tuple[str, ...]) -> str:
    joined = " ".join(flags).replace("=", " ")
    return "priority" if "--scheduling-policy priority" in joined else "fcfs"
