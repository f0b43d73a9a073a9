"""Real vLLM (the CPU build) as a child process: start it with given flags, wait until
it is ready, read its process tree's memory, stop it.

The server runs ``python -m vllm.entrypoints.openai.api_server`` from its own virtual
environment (``.venv-vllm``, built by ``make vllm-venv``) on the small model that
``e2e/build_tiny_model.py`` builds (``make tiny-model``); nothing here imports vllm or
torch. Its output goes to a log file. It is ready once ``/health`` answers 200: the
first start on a machine compiles, later ones reuse vLLM's cache.
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
from dataclasses import dataclass
from pathlib import Path

from loadtests.support.processes import free_port, wait_until_ok

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
# A load takes 60-130 s alone on two cores (compiling on a fresh machine), and more
# beside other work: 180 s was once too little for the tier's fleet to come back.
READY_TIMEOUT_S = float(os.environ.get("WHOSETURN_E2E_READY_TIMEOUT_S", "480"))
STOP_TIMEOUT_S = 30.0
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def cpu_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The model's dtype on this CPU: ``bfloat16`` where the CPU computes in it
    (AVX-512 BF16 or AMX), else ``float32``. Without them vLLM's CPU build
    emulates bf16: on an AVX-only EPYC a 6,987-token prefill of the tiny model took
    28-33 s in bfloat16 and 10-13 s in float32 (docs/real-vllm.md)."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return "bfloat16"
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def base_flags() -> tuple[str, ...]:
    """The flags every server of the tier is started with, before an arm's own."""
    return ("--served-model-name", MODEL_NAME, "--dtype", cpu_dtype(), "--max-model-len", "8192")


_PR_SET_PDEATHSIG = 1
# _SAME_SESSION: the server stays in the session of whoever starts it. With the
# kernel's autogroup scheduling on (``/proc/sys/kernel/sched_autogroup_enabled``, as
# on this project's machines), a new session is a new scheduling group, and the
# engine core's busy wait on its worker (vLLM's shared-memory queue spins on
# sched_yield for a second after every read) then starved every process of the other
# group, the load generator, the proxy and the stall watch among them, for 1-4 s at a
# time (measured in docs/real-vllm.md, "Machine stops"). In one group the same
# workload ran without a stop over 0.12 s.


class VllmNotBuilt(RuntimeError):
    """``.venv-vllm`` or the model is missing: ``make vllm-venv tiny-model`` builds both."""


def _from_env(name: str, default: str) -> Path:
    path = Path(os.environ.get(name) or default)
    return path if path.is_absolute() else REPO / path


def vllm_python() -> Path:
    """``$WHOSETURN_E2E_VLLM_PYTHON``, else ``.venv-vllm/bin/python``."""
    return _from_env("WHOSETURN_E2E_VLLM_PYTHON", ".venv-vllm/bin/python")


def model_dir() -> Path:
    """``$WHOSETURN_E2E_MODEL``, else ``.cache/tiny-model``."""
    return _from_env("WHOSETURN_E2E_MODEL", ".cache/tiny-model")


@dataclass
class VllmProcess:
    """One running vLLM API server."""

    flags: tuple[str, ...]
    base_url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    ready_after_s: float = 0.0

    @property
    def command(self) -> str:
        """The launch command, as a person would type it (model path shortened)."""
        return " ".join(
            [
                "python -m vllm.entrypoints.openai.api_server --model .cache/tiny-model",
                *list(base_flags() + self.flags),
            ]
        )

    def peak_rss_bytes(self) -> int:
        """The summed peak resident memory (``VmHWM``) of the server's processes: the
        API server, its engine core and workers."""
        total = 0
        for pid in _group_pids(self.process.pid):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
        return total

    def stop(self) -> None:
        """``SIGTERM`` the process group, ``SIGKILL`` what is left after the grace."""
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait(10)
        _signal_group(self.process, signal.SIGKILL)  # orphaned children, if any


def start_vllm(flags: tuple[str, ...], log_dir: Path, *, index: int = 0) -> VllmProcess:
    """Start one server with ``flags`` on a free loopback port and wait until it is
    ready; raises with its log's tail if it exits or is not ready within
    ``READY_TIMEOUT_S``."""
    python, model = vllm_python(), model_dir()
    if not python.exists() or not (model / "config.json").exists():
        raise VllmNotBuilt(f"need {python} and {model}: run `make vllm-venv tiny-model`")
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", " ".join(flags).lower()).strip("-") or "default"
    log_path = log_dir / f"vllm-{index:02d}-{slug}.log"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += [*base_flags(), "--host", "127.0.0.1", "--port", str(port), *flags]
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENGINE_ENV},
            cwd=REPO,
            # Its own process group (so that stop() reaches its engine core and
            # worker), but not its own session: see _SAME_SESSION.
            process_group=0,
            preexec_fn=_die_with_parent,
        )
    atexit.register(_kill_if_running, process)
    server = VllmProcess(flags, f"http://127.0.0.1:{port}", port, process, log_path)
    try:
        _wait_healthy(server)
    except BaseException:
        server.stop()
        raise
    server.ready_after_s = time.monotonic() - started
    return server


def _wait_healthy(server: VllmProcess) -> None:
    try:
        wait_until_ok(
            f"{server.base_url}/health",
            process=server.process,
            what="vLLM",
            timeout_s=READY_TIMEOUT_S,
            interval_s=0.5,
        )
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; {server.log_path}:\n{tail(server.log_path)}") from exc


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                # the fields after the parenthesised command: state, ppid, pgrp, ...
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.append(int(entry.name))
    return pids


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _kill_if_running(process: subprocess.Popen[bytes]) -> None:
    """At exit, for a server that no teardown stopped."""
    if process.poll() is None:
        _signal_group(process, signal.SIGKILL)


def _die_with_parent() -> None:
    """In the child: ``SIGTERM`` the server if its parent dies without teardown."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
