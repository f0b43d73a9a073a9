"""The repository's ``Dockerfile`` built and run: the proxy in a container (host
network, a read-only root filesystem as in deploy/k8s, configured by a mounted YAML
file and the environment) in front of a
simulated engine on this host answers ``/readyz``, a chat request, a batch request,
a Batch API job stored on its volume and ``/metrics``, as a non-root user; Docker's
own health check sees it healthy; ``docker stop`` drains it and it exits cleanly.
The same image runs the simulated engine (the compose file's laptop profile)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import yaml

from tests.support import MODEL
from tests.support.children import logged_sim
from tests.support.processes import free_port, loopback_url, wait_until_ok

from .conftest import docker, wait_for_model

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]
UID = "10001"


@dataclass
class Container:
    name: str
    url: str


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A simulated engine on this host (the container reaches it over the host network)."""
    with logged_sim(tmp_path_factory.mktemp("logs")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def proxy(image: str, sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """The proxy's container: engines from the mounted file, the port from the environment."""
    config = tmp_path_factory.mktemp("config") / "whoseturn.yaml"
    config.write_text(yaml.safe_dump({"engines": [{"url": sim, "name": "sim-0"}]}))
    config.chmod(0o644)
    port = free_port()
    name = f"whoseturn-docker-tier-{port}"
    docker(
        "run", "-d", "--name", name, "--network", "host", "--read-only", "--tmpfs", "/tmp",
        "-e", f"WHOSETURN_PORT={port}",
        "-v", f"{config}:/etc/whoseturn/whoseturn.yaml:ro",
        image,
    )  # fmt: skip
    container = Container(name, loopback_url(port))
    try:
        wait_until_ok(f"{container.url}/readyz", what="the proxy's container", timeout_s=60)
        wait_for_model(container.url)
        yield container
    except Exception:
        print(docker("logs", name, check=False))
        raise
    finally:
        docker("rm", "-f", "-v", name, check=False)


def test_ready_as_a_non_root_user(proxy: Container) -> None:
    assert httpx.get(f"{proxy.url}/readyz").status_code == 200
    status = docker("exec", proxy.name, "cat", "/proc/1/status")
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert set(uids) == {UID}, status


def test_chat_through_the_container(proxy: Container) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    response = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["x-whoseturn-class"] == "interactive"
    assert response.headers["x-whoseturn-engine"] == "sim-0"
    assert response.json()["choices"][0]["message"]["content"]


def test_batch_route_through_the_container(proxy: Container) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    response = httpx.post(f"{proxy.url}/batch/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["x-whoseturn-class"] == "batch"


def test_batch_job_stored_on_the_volume(proxy: Container) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        }
        for i in range(3)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while batch.status not in {"completed", "failed", "expired", "cancelled"}:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None
    output = client.files.content(batch.output_file_id).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == [
        "line-0",
        "line-1",
        "line-2",
    ]
    store = docker("exec", proxy.name, "ls", "-ln", "/var/lib/whoseturn")
    assert "batch.sqlite3" in store and f" {UID} " in store, store


def test_metrics_through_the_container(proxy: Container) -> None:
    text = httpx.get(f"{proxy.url}/metrics").text
    assert 'whoseturn_engine_up{engine="sim-0"} 1.0' in text
    for cls in ("interactive", "batch"):
        assert f'whoseturn_requests_total{{class="{cls}",engine="sim-0",outcome="ok"}}' in text


def test_docker_health_check_sees_it_healthy(proxy: Container) -> None:
    deadline = time.monotonic() + 60
    while (health := docker("inspect", "-f", "{{.State.Health.Status}}", proxy.name)) != "healthy":
        assert health in {"starting", "healthy"}, health
        assert time.monotonic() < deadline, health
        time.sleep(1)


def test_docker_stop_drains_and_exits_cleanly(proxy: Container) -> None:
    docker("stop", "-t", "30", proxy.name, timeout=60)
    assert docker("inspect", "-f", "{{.State.ExitCode}}", proxy.name) == "0"


def test_image_runs_the_simulated_engine(image: str) -> None:
    port = free_port()
    name = f"whoseturn-docker-tier-sim-{port}"
    docker(
        "run", "-d", "--name", name, "--network", "host", "--no-healthcheck", image,
        "sim", "--profile", "cpu-tiny", "--served-model-name", MODEL, "--port", str(port),
    )  # fmt: skip
    try:
        wait_until_ok(f"{loopback_url(port)}/health", what="the image's sim", timeout_s=60)
        models = httpx.get(f"{loopback_url(port)}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
    finally:
        docker("rm", "-f", name, check=False)


def test_image_is_small_and_carries_no_torch(image: str) -> None:
    size = int(docker("image", "inspect", "-f", "{{.Size}}", image))
    print(f"image {image}: {size / 1e6:.0f} MB")
    assert size < 400e6
    probe = "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('pytest'))"
    assert docker("run", "--rm", "--entrypoint", "python3", image, "-c", probe) == "None None"
