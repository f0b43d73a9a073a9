"""The ``Dockerfile`` read offline (``tests/docker`` builds and runs it): the base image
a build argument defaulting to the official Python slim image, two stages, a numeric
non-root user, a health check on ``/readyz``, the proxy as the default command, and a
build context of the package sources only."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^{name}\s+(.*)$", DOCKERFILE, re.MULTILINE)]


def test_base_is_a_build_argument_with_the_python_slim_default() -> None:
    assert "BASE=python:3.11-slim" in instructions("ARG")
    assert [f.split()[0] for f in instructions("FROM")] == ["${BASE}", "${BASE}"]


def test_runs_as_a_numeric_non_root_user() -> None:
    (user,) = instructions("USER")
    assert all(part.isdigit() and int(part) != 0 for part in user.split(":"))


def test_health_check_and_default_command() -> None:
    assert "/readyz" in DOCKERFILE[DOCKERFILE.index("HEALTHCHECK") :]
    assert instructions("ENTRYPOINT") == ['["whoseturn"]']
    assert instructions("CMD") == ['["serve"]']


def test_installs_the_package_without_its_dev_extras() -> None:
    assert "pip install ." in DOCKERFILE and "[dev]" not in DOCKERFILE
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in dependencies if d.startswith(("torch", "vllm"))]


def test_build_context_is_the_package_sources() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*") + 1 :][:4] == [
        "!pyproject.toml",
        "!README.md",
        "!proxy/",
        "!loadtests/",
    ]
    copied = {c.split()[0] for c in instructions("COPY") if not c.startswith("--from")}
    assert copied == {"pyproject.toml", "proxy", "loadtests"}
