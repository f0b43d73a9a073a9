"""Engines the harness starts itself, when a workload file names their launch command
(``engines:``), and the proxy in front of them (``proxy:``).

Each arm gets fresh engines (no arm inherits another's caches). An engine's start is
timed from spawn to the first 200 of its health path: that is the model load, the
cold run's first phase. Then the facts of its start that change what is measured,
chunked prefill, the step's token budget, the long-prefill threshold, the scheduling
policy and prefix caching, are read from its launch flags, its log and its
``/metrics`` (:func:`startup_facts`), each with where it was read; a fact stated
nowhere is recorded as such, not guessed. The engines run in their own process
group, stopped with ``SIGTERM`` to the group (``SIGKILL`` after a grace) so that an
engine's children (vLLM's engine core and workers) stop with it.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.harness.workload_file import ArmSpec, Engines, Workload
from loadtests.support.processes import free_port, loopback_url, serve_command, wait_until_ok

STOP_GRACE_S = 30.0
FACTS = (
    "chunked_prefill",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "scheduling_policy",
    "prefix_caching",
    "max_num_seqs",
)
"""The startup facts that change what is measured, by their vLLM argument names."""

_VALUE_FLAGS = {
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--long-prefill-token-threshold": "long_prefill_token_threshold",
    "--scheduling-policy": "scheduling_policy",
    "--max-num-seqs": "max_num_seqs",
}
_BOOL_FLAGS = {
    "--enable-chunked-prefill": ("chunked_prefill", True),
    "--no-enable-chunked-prefill": ("chunked_prefill", False),
    "--enable-prefix-caching": ("prefix_caching", True),
    "--no-enable-prefix-caching": ("prefix_caching", False),
}
_LOG_PATTERNS = (
    (re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)"), "chunked"),
    (re.compile(r"non-default args: (\{.*\})"), "args"),
    (re.compile(r"enable_prefix_caching=(True|False)"), "prefix_caching"),
    (re.compile(r"enable_chunked_prefill=(True|False)"), "chunked_prefill"),
)
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)


def _value(text: str) -> Any:
    with contextlib.suppress(ValueError):
        return int(text)
    return text


def startup_facts(argv: list[str], log: str, metrics: str) -> dict[str, dict[str, Any]]:
    """``{fact: {"value": V, "from": "flag" | "log" | "metrics"}}`` for every fact of
    :data:`FACTS`; ``{"value": None, "from": "not stated (the engine's default)"}``
    for one stated nowhere. A flag wins over the log, the log over the metrics."""
    found: dict[str, dict[str, Any]] = {}

    def put(fact: str, value: Any, where: str) -> None:
        found.setdefault(fact, {"value": value, "from": where})

    for i, arg in enumerate(argv):
        name, _, inline = arg.partition("=")
        if name in _VALUE_FLAGS and (inline or i + 1 < len(argv)):
            put(_VALUE_FLAGS[name], _value(inline or argv[i + 1]), "flag")
        elif arg in _BOOL_FLAGS:
            put(*_BOOL_FLAGS[arg], "flag")
    for pattern, kind in _LOG_PATTERNS:
        for match in pattern.finditer(log):
            if kind == "chunked":
                put("chunked_prefill", True, "log")
                put("max_num_batched_tokens", int(match.group(1)), "log")
            elif kind == "args":
                with contextlib.suppress(ValueError, SyntaxError):
                    args = ast.literal_eval(match.group(1))
                    for key in (
                        "max_num_batched_tokens",
                        "long_prefill_token_threshold",
                        "scheduling_policy",
                        "max_num_seqs",
                    ):
                        if key in args:
                            put(key, args[key], "log")
                    if "enable_prefix_caching" in args:
                        put("prefix_caching", bool(args["enable_prefix_caching"]), "log")
                    if "enable_chunked_prefill" in args:
                        put("chunked_prefill", bool(args["enable_chunked_prefill"]), "log")
            else:
                put(kind, match.group(1) == "True", "log")
    for match in _CACHE_INFO.finditer(metrics):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if "enable_prefix_caching" in labels:
            put("prefix_caching", labels["enable_prefix_caching"] == "True", "metrics")
    for fact in FACTS:
        put(fact, None, "not stated (the engine's default)")
    return {fact: found[fact] for fact in FACTS}


def engine_argv(command: str, port: int, engine_args: str = "") -> list[str]:
    """The argument list of an engine's ``command`` on ``port``: placeholders filled
    in (an arm's ``engine_args`` at ``{engine_args}``, else at the end), and
    ``whoseturn`` run as this interpreter's ``python -m proxy``."""
    from loadtests.support.vllm import cpu_dtype, model_dir, vllm_python

    if engine_args and "{engine_args}" not in command:
        command += " {engine_args}"
    filled = command.format(
        port=port,
        python=sys.executable,
        vllm_python=vllm_python(),
        model_dir=model_dir(),
        dtype=cpu_dtype(),
        engine_args=engine_args,
    )
    argv = shlex.split(filled)
    if argv and argv[0] == "whoseturn":
        argv = [sys.executable, "-m", "proxy", *argv[1:]]
    return argv


@dataclass
class Server:
    """One started server: its name, URL, process, log and how long it took to be ready."""

    name: str
    url: str
    argv: list[str]
    process: subprocess.Popen[bytes]
    log: Path
    ready_s: float = 0.0
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "command": shlex.join(self.argv),
            "ready_s": round(self.ready_s, 3),
            "log": self.log.name,
            **({"startup_facts": self.facts} if self.facts else {}),
        }


@dataclass
class Started:
    """One arm's servers: the engines, and the proxy when the arm goes through one."""

    engines: list[Server]
    proxy: Server | None = None

    def servers(self) -> list[Server]:
        return [*self.engines, *([self.proxy] if self.proxy else [])]


@contextmanager
def started(out: Path, arm_spec: ArmSpec, workload: Workload) -> Iterator[Started]:
    """Start ``workload``'s engines (and, for the proxy arm, ``whoseturn serve`` in
    front of them), time each until ready, read the engines' startup facts; yield
    them; stop them all on exit. Logs go to ``out/<arm>-*.log``."""
    spec, arm = workload.engines, arm_spec.name
    if spec is None:
        raise ValueError(f"{workload.name}: the workload names no engines")
    with ExitStack() as stack:
        engines = []
        for n in range(spec.count):  # all spawned first: they load side by side
            port = free_port()
            log = out / f"{arm}-engine-{n}.log"
            argv = engine_argv(spec.command, port, arm_spec.engine_args)
            process = _spawn(argv, log, spec, stack)
            engines.append(Server(f"engine-{n}", loopback_url(port), argv, process, log))
        spawned = time.monotonic()
        for engine in engines:
            wait_until_ok(
                engine.url + spec.health,
                process=engine.process,
                what=f"{engine.name} (see {engine.log})",
                timeout_s=spec.ready_timeout_s,
                interval_s=0.1,
            )
            engine.ready_s = time.monotonic() - spawned
            engine.facts = startup_facts(engine.argv, _read(engine.log), _metrics(engine.url))
        proxy = None
        if arm_spec.via == "proxy":
            port = free_port()
            listed = [
                {"url": e.url, "name": e.name, "models": [workload.model], **arm_spec.proxy_engine}
                for e in engines
            ]
            argv = serve_command(
                out / f"{arm}-proxy.yaml",
                port=port,
                engines=listed,
                **proxy_settings(workload, out, arm),
            )
            log = out / f"{arm}-proxy.log"
            began = time.monotonic()
            process = _spawn(argv, log, None, stack)
            proxy = Server("proxy", loopback_url(port), argv, process, log)
            wait_until_ok(
                f"{proxy.url}/readyz",
                process=process,
                what=f"the proxy (see {log})",
                timeout_s=spec.ready_timeout_s,
            )
            proxy.ready_s = time.monotonic() - began
        yield Started(engines, proxy)


def proxy_settings(workload: Workload, out: Path, arm: str) -> dict[str, Any]:
    """The workload's proxy settings, with a fresh batch store in ``out`` when a class
    uses the Batch API and the settings name none."""
    settings = dict(workload.proxy_settings or {})
    if any(c.route == "batch-api" for c in workload.classes):
        settings.setdefault("batch_store_path", str(out / f"{arm}-batch.db"))
    return settings


def _spawn(
    argv: list[str], log: Path, spec: Engines | None, stack: ExitStack
) -> subprocess.Popen[bytes]:
    env = {**os.environ, **(spec.env if spec else {})}
    with log.open("ab") as f:
        process = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, process_group=0
        )
    stack.callback(stop_group, process)
    return process


def stop_group(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """``SIGTERM`` ``process``'s group; ``SIGKILL`` it if still there after ``grace_s``."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # what is left of the group, if anything
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def _metrics(url: str) -> str:
    try:
        return httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""
