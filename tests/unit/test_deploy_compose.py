"""``deploy/compose/`` checked offline, in both profiles: the compose file parses; every
file it mounts exists in the repository; the engines each profile starts answer to the
names and port the proxy's settings (loaded by the proxy's own loader) and Prometheus'
targets use; the postgres profile's PostgreSQL (official Debian-based image, named
volume, healthcheck) is where both proxy replicas' Batch API store and budget ledger
point once ``postgres.env`` is used, and nowhere without it; the proxy's port lines up
with its published port and its scrape target; Prometheus loads
``deploy/prometheus/rules.yml``; Grafana's provisioning points at the stack's Prometheus
and at the mounted ``dashboards/``. Images are either built from the repository's
Dockerfile or named from their publishers' repositories."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy/compose"
PROFILES = ("laptop", "gpu")
ALWAYS = {"whoseturn", "prometheus", "grafana"}
PROXIES = ("whoseturn", "whoseturn-2")
PUBLISHED = ("vllm/vllm-openai:", "prom/prometheus:", "grafana/grafana:", "postgres:")
PROXY_IMAGE = "whoseturn:local"


def with_defaults(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose's ``${NAME:-default}`` interpolation (the environment empty unless given)."""
    env = env or {}
    if isinstance(value, str):
        return re.sub(r"\$\{([A-Z0-9_]+):-([^}]*)\}", lambda m: env.get(m[1]) or m[2], value)
    if isinstance(value, list):
        return [with_defaults(v, env) for v in value]
    if isinstance(value, dict):
        return {k: with_defaults(v, env) for k, v in value.items()}
    return value


def env_file(path: Path) -> dict[str, str]:
    """A compose ``--env-file``: ``NAME=value`` lines, ``#`` comments."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def read_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    return dict(with_defaults(yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text()), env))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return read_compose()


def services_in(compose: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    return {
        name: s
        for name, s in compose["services"].items()
        if not s.get("profiles") or profile in s["profiles"]
    }


def proxy_env(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in service["environment"].items()}


def test_postgres_profile_is_postgresql_on_a_named_volume_with_a_healthcheck(
    compose: dict[str, Any],
) -> None:
    postgres = compose["services"]["postgres"]
    assert postgres["profiles"] == ["postgres"]
    image, _, tag = postgres["image"].partition(":")
    assert image == "postgres" and tag.endswith(("-bookworm", "-trixie")), postgres["image"]
    (volume,) = postgres["volumes"]
    name, target = volume.split(":")
    assert name in compose["volumes"] and target == "/var/lib/postgresql/data"
    check = postgres["healthcheck"]["test"]
    assert check[:2] == ["CMD", "pg_isready"]
    environment = postgres["environment"]
    assert flag(check, "--username") == environment["POSTGRES_USER"]
    assert flag(check, "--dbname") == environment["POSTGRES_DB"]
    second = compose["services"]["whoseturn-2"]
    assert second["profiles"] == ["postgres"]
    assert second["depends_on"] == {"postgres": {"condition": "service_healthy"}}


@pytest.mark.parametrize("proxy", PROXIES)
def test_postgres_env_points_every_replica_at_the_stacks_postgresql(proxy: str) -> None:
    env = env_file(COMPOSE_DIR / "postgres.env")
    compose = read_compose(env)
    postgres = compose["services"]["postgres"]["environment"]
    settings = load_settings(
        str(COMPOSE_DIR / "whoseturn.yaml"),
        env=proxy_env(compose["services"][proxy]),
        cwd=COMPOSE_DIR,
    )
    assert settings.batch.store == "postgres"
    for dsn in (settings.batch.dsn, settings.replicas.ledger_dsn):
        url = urlsplit(dsn)
        assert (url.hostname, url.port) == ("postgres", 5432), proxy
        assert url.username == postgres["POSTGRES_USER"]
        assert url.password == postgres["POSTGRES_PASSWORD"]
        assert url.path == "/" + postgres["POSTGRES_DB"]
    assert settings.batch.dsn == settings.replicas.ledger_dsn


@pytest.mark.parametrize("proxy", PROXIES)
def test_without_postgres_env_the_proxy_keeps_sqlite_and_its_own_budget(
    compose: dict[str, Any], proxy: str
) -> None:
    settings = load_settings(
        str(COMPOSE_DIR / "whoseturn.yaml"),
        env=proxy_env(compose["services"][proxy]),
        cwd=COMPOSE_DIR,
    )
    assert (settings.batch.store, settings.batch.dsn, settings.replicas.ledger_dsn) == (
        "sqlite",
        "",
        "",
    )


def test_the_replicas_publish_different_ports_and_keep_their_own_volumes(
    compose: dict[str, Any],
) -> None:
    ports = [compose["services"][p]["ports"][0].split(":") for p in PROXIES]
    assert len({host for host, _ in ports}) == len(PROXIES)
    named = [
        v.split(":")[0] for p in PROXIES for v in compose["services"][p]["volumes"] if v[0] != "."
    ]
    assert len(set(named)) == len(named)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host source of each bind mount (``./`` or ``../``)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = source
    return out


def proxy_settings() -> Any:
    return load_settings(str(COMPOSE_DIR / "whoseturn.yaml"), env={}, cwd=COMPOSE_DIR)


def test_profiles_are_laptop_and_gpu_and_the_rest_runs_in_both(
    compose: dict[str, Any],
) -> None:
    profiled = {p for s in compose["services"].values() for p in s.get("profiles", [])}
    assert profiled == {*PROFILES, "postgres"}
    unprofiled = {n for n, s in compose["services"].items() if not s.get("profiles")}
    assert unprofiled == ALWAYS


@pytest.mark.parametrize("profile", PROFILES)
def test_engines_answer_where_the_proxy_and_prometheus_look(
    compose: dict[str, Any], profile: str
) -> None:
    engines = {
        alias: int(flag(s["command"], "--port"))
        for s in services_in(compose, profile).values()
        if s.get("profiles")
        for alias in s["networks"]["default"]["aliases"]
    }
    settings = proxy_settings()
    wanted = {urlsplit(e.url).hostname: urlsplit(e.url).port for e in settings.engines}
    assert engines == wanted
    prometheus = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in prometheus["scrape_configs"]}
    assert sorted(jobs["vllm"]) == sorted(f"{host}:{port}" for host, port in engines.items())


def test_laptop_engines_are_the_simulator_from_the_proxy_image(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if service.get("profiles") == ["laptop"]:
            assert service["image"] == PROXY_IMAGE, name
            assert service["command"][:3] == ["sim", "--profile", "cpu-tiny"], name
            assert flag(service["command"], "--host") == "0.0.0.0", name


def test_gpu_engines_are_vllm_on_a_gpu(compose: dict[str, Any]) -> None:
    gpu = [s for s in compose["services"].values() if s.get("profiles") == ["gpu"]]
    assert gpu
    for service in gpu:
        assert service["image"].startswith("vllm/vllm-openai:")
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert flag(service["command"], "--host") == "0.0.0.0"


def test_proxy_port_and_scrape_target_line_up(compose: dict[str, Any]) -> None:
    settings = proxy_settings()
    proxy = compose["services"]["whoseturn"]
    published = [p.split(":") for p in proxy["ports"]]
    assert [int(container) for _, container in published] == [settings.serving.port]
    assert settings.serving.host == "0.0.0.0"
    prometheus = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in prometheus["scrape_configs"]}
    assert jobs["whoseturn"] == [f"whoseturn:{settings.serving.port}"]
    assert mounts(proxy)["/etc/whoseturn/whoseturn.yaml"] == "./whoseturn.yaml"


def test_batch_store_is_on_a_named_volume(compose: dict[str, Any]) -> None:
    proxy = compose["services"]["whoseturn"]
    store = PurePosixPath(proxy["environment"]["WHOSETURN_BATCH_STORE_PATH"])
    named = {v.split(":")[1]: v.split(":")[0] for v in proxy["volumes"] if not v.startswith(".")}
    assert named[str(store.parent)] in compose["volumes"]


def test_every_mounted_file_exists_in_the_repository(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for target, source in mounts(service).items():
            assert (COMPOSE_DIR / source).exists(), f"{name}: {source} -> {target}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith(".") or source in compose["volumes"], f"{name}: {volume}"


def test_images_are_built_here_or_published(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if "build" in service:
            assert service["image"] == PROXY_IMAGE
            context = COMPOSE_DIR / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).is_file(), name
        else:
            assert service["image"].startswith(PUBLISHED), name


def test_prometheus_loads_the_repository_rules(compose: dict[str, Any]) -> None:
    service = compose["services"]["prometheus"]
    config_path = PurePosixPath(flag_value(service["command"], "--config.file"))
    bound = mounts(service)
    assert bound[str(config_path)] == "./prometheus.yml"
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        target = str(config_path.parent / rule_file)
        assert (COMPOSE_DIR / bound[target]).resolve() == ROOT / "deploy/prometheus/rules.yml"


def flag_value(command: list[str], name: str) -> str:
    return next(c.split("=", 1)[1] for c in command if c.startswith(name + "="))


def test_grafana_provisions_the_datasource_and_the_dashboards(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    bound = mounts(grafana)
    provisioning = "/etc/grafana/provisioning"
    for kind in ("datasources", "dashboards"):
        assert (COMPOSE_DIR / bound[f"{provisioning}/{kind}"]).resolve() == (
            COMPOSE_DIR / f"grafana/provisioning/{kind}"
        )
    sources = yaml.safe_load(
        (COMPOSE_DIR / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    (source,) = sources["datasources"]
    url = urlsplit(source["url"])
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert (
        url.hostname == "prometheus"
        and f"{url.port}:{url.port}" in compose["services"]["prometheus"]["ports"]
    )
    providers = yaml.safe_load(
        (COMPOSE_DIR / "grafana/provisioning/dashboards/whoseturn.yaml").read_text()
    )
    (provider,) = providers["providers"]
    dashboards = (COMPOSE_DIR / bound[provider["options"]["path"]]).resolve()
    assert dashboards == ROOT / "dashboards"
    assert (dashboards / "whoseturn.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert PurePosixPath(home).parent == PurePosixPath(provider["options"]["path"])
    assert (dashboards / PurePosixPath(home).name).is_file()
