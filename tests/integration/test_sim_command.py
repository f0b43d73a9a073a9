"""``whoseturn sim`` serves the simulated engine and stops cleanly on Ctrl-C; flags given
before a subcommand reach it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from proxy.cli import main

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited early"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url}/health never answered 200")


def test_sim_command_serves_until_interrupted() -> None:
    port = free_port()
    command = [sys.executable, "-m", "proxy", "--log-level", "warning", "sim"]
    command += ["--profile", "cpu-tiny", "--port", str(port), "--time-scale", "20"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert reply.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=15)
    assert process.returncode == 0, output.decode()


def test_flags_before_a_subcommand_reach_it(capsys: pytest.CaptureFixture[str]) -> None:
    """``whoseturn sim --profile cpu-tiny interference`` runs cpu-tiny, not the default."""
    argv = ["--log-level", "warning", "sim", "--profile", "cpu-tiny"]
    argv += ["--max-num-batched-tokens", "512", "interference"]
    assert main([*argv, "--batch-prompts", "2", "--batch-prompt-tokens", "1000"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("Profile `cpu-tiny`, virtual time; engine: 512-token steps")
