"""The image tier: a real Docker engine builds the repository's ``Dockerfile`` and runs it.

No image registry is reachable here, so the base image is a local stand-in for
``python:3.11-slim`` made from Debian's packages (``build-base.sh``: debootstrap, then
``docker import``; built once and cached by its tag), and pip inside the build installs
offline from a wheelhouse built on this host and served on a loopback port
(``--network host``). ``make test-docker`` installs Docker and debootstrap, starts
``dockerd`` if none answers, and runs this tier.
"""

from __future__ import annotations

import http.server
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.support import MODEL

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "whoseturn-base:bookworm"
IMAGE = "whoseturn:docker-tier"


def docker(*args: str, timeout: float = 60.0, check: bool = True) -> str:
    """Run ``docker ARGS``; its stdout. A failure quotes stderr."""
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout.strip()


@pytest.fixture(scope="session")
def docker_engine() -> None:
    if shutil.which("docker") is None:
        pytest.fail("no docker command: `make test-docker` installs Debian's docker.io")
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        pytest.fail("no Docker engine answers: `make test-docker` starts dockerd")


@pytest.fixture(scope="session")
def base_image(docker_engine: None) -> str:
    subprocess.run([str(ROOT / "tests/docker/build-base.sh"), BASE_IMAGE], check=True, timeout=900)
    return BASE_IMAGE


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The project's wheels, its dependencies' and its build backend's, served over HTTP
    on loopback (a find-links page) for the image build's offline pip."""
    house = tmp_path_factory.mktemp("wheelhouse")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(ROOT), "-w", str(house)], check=True, timeout=600)
    subprocess.run(
        [*pip, "download", "setuptools>=77", "wheel", "-d", str(house)], check=True, timeout=600
    )
    handler = partial(QuietHandler, directory=str(house))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{server.server_address[1]}/"
        server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def image(base_image: str, wheelhouse: str) -> Iterator[str]:
    """The repository's Dockerfile, built on the local base with offline pip."""
    docker(
        "build",
        "--network", "host",
        "--build-arg", f"BASE={base_image}",
        "--build-arg", "PIP_NO_INDEX=1",
        "--build-arg", f"PIP_FIND_LINKS={wheelhouse}",
        "-t", IMAGE,
        str(ROOT),
        timeout=900,
    )  # fmt: skip
    yield IMAGE


def wait_for_model(url: str, timeout_s: float = 60.0) -> None:
    """Wait until the proxy at ``url`` lists the test model: ``/readyz`` answers once an
    engine is up, and the engines' models are asked for just after."""
    deadline = time.monotonic() + timeout_s
    while True:
        models = httpx.get(f"{url}/v1/models", timeout=5).json().get("data", [])
        if MODEL in [m["id"] for m in models]:
            return
        assert time.monotonic() < deadline, f"{url} does not list {MODEL}: {models}"
        time.sleep(0.2)
