"""``deploy/compose/compose.yaml`` through Debian's ``docker-compose``: ``config`` accepts
both profiles, and the postgres profile with ``postgres.env`` (every proxy replica then
on the stack's PostgreSQL), and the part of the laptop profile whose images are local (the two
simulated engines and the proxy, all from the image the tier built) comes up on a
compose network and serves: both engines ready, a chat request, a Batch API job kept
on the named volume, metrics. Prometheus and Grafana are published images that no
registry here can give; the offline checks in tests/unit/test_deploy_compose.py cover
their files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support import MODEL
from tests.support.processes import free_port, loopback_url, wait_until_ok

from .conftest import wait_for_model

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]
COMPOSE_DIR = Path(__file__).resolve().parents[2] / "deploy/compose"
LOCAL = ("sim-0", "sim-1", "whoseturn")


def compose(*args: str, env: dict[str, str], timeout: float = 180) -> str:
    if shutil.which("docker-compose") is None:
        pytest.fail("no docker-compose: `make test-docker` installs Debian's docker-compose")
    done = subprocess.run(
        ["docker-compose", *args],
        cwd=COMPOSE_DIR,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"docker-compose {' '.join(args)}:\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("profile", ["laptop", "gpu"])
def test_compose_config_accepts_the_profile(profile: str) -> None:
    services = compose("--profile", profile, "config", "--services", env={}).split()
    engines = {"laptop": ["sim-0", "sim-1"], "gpu": ["vllm-0", "vllm-1"]}[profile]
    assert set(engines) <= set(services)


def test_compose_config_accepts_the_postgres_profile_with_its_env_file() -> None:
    args = ["--env-file", "postgres.env", "--profile", "laptop", "--profile", "postgres"]
    config = yaml.safe_load(compose(*args, "config", env={}))
    services = config["services"]
    assert {"postgres", "whoseturn", "whoseturn-2"} <= set(services)
    for proxy in ("whoseturn", "whoseturn-2"):
        environment = services[proxy]["environment"]
        assert environment["WHOSETURN_BATCH_STORE"] == "postgres", proxy
        assert "@postgres:5432/" in environment["WHOSETURN_BATCH_DSN"], proxy
        assert environment["WHOSETURN_LEDGER_DSN"] == environment["WHOSETURN_BATCH_DSN"]


@pytest.fixture(scope="module")
def stack(image: str) -> Iterator[str]:
    port = free_port()
    project = f"whoseturn-docker-tier-{port}"
    env = {"WHOSETURN_IMAGE": image, "WHOSETURN_PORT": str(port)}
    base = ["-p", project, "--profile", "laptop"]
    try:
        compose(*base, "up", "-d", "--no-build", *LOCAL, env=env)
        url = loopback_url(port)
        wait_until_ok(f"{url}/readyz", what="the compose stack's proxy", timeout_s=90)
        wait_for_model(url)
        yield url
    finally:
        compose(*base, "down", "-v", "--timeout", "40", env=env)


def test_laptop_stack_serves_through_the_proxy(stack: str) -> None:
    deadline = time.monotonic() + 30
    while set(httpx.get(f"{stack}/readyz").json()["engines_up"]) != {"engine-0", "engine-1"}:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat = httpx.post(f"{stack}/v1/chat/completions", json=body, timeout=30)
    assert chat.status_code == 200, chat.text
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    upload = httpx.post(
        f"{stack}/v1/files",
        files={"file": ("in.jsonl", json.dumps(line) + "\n")},
        data={"purpose": "batch"},
    )
    assert upload.status_code == 200, upload.text
    create = {
        "input_file_id": upload.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    batch = httpx.post(f"{stack}/v1/batches", json=create).json()
    deadline = time.monotonic() + 60
    while batch["status"] not in {"completed", "failed", "expired", "cancelled"}:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = httpx.get(f"{stack}/v1/batches/{batch['id']}").json()
    assert batch["status"] == "completed", batch
    metrics = httpx.get(f"{stack}/metrics").text
    assert 'whoseturn_engine_up{engine="engine-0"} 1.0' in metrics
    assert 'whoseturn_engine_up{engine="engine-1"} 1.0' in metrics
