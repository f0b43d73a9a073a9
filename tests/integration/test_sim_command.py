"""``whoseturn sim`` serves the simulated engine and stops cleanly on Ctrl-C; flags given
before a subcommand reach it."""

from __future__ import annotations

import signal
import subprocess

import httpx
import pytest

from proxy.cli import main
from tests.support.processes import free_port, loopback_url, sim_command, wait_until_ok

pytestmark = pytest.mark.integration


def test_sim_command_serves_until_interrupted() -> None:
    port = free_port()
    command = sim_command("--port", str(port), "--time-scale", "20")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = loopback_url(port)
        wait_until_ok(f"{url}/health", process=process, what="whoseturn sim", timeout_s=20)
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
