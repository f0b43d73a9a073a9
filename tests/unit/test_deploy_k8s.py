"""``deploy/k8s/`` checked offline: every overlay rendered and every object validated.

There is no ``kustomize`` binary here, so :func:`render` implements the part of
kustomize these files use (resources, RFC 6902 ``patches`` by kind and name, ``labels``
pairs, ``images``), in kustomize's order. Built-in kinds are validated against the
Kubernetes OpenAPI schemas bundled in PyPI's ``kubernetes-validate`` (strict: no
unknown fields); the Prometheus operator's PodMonitor, a custom resource those schemas
lack, is checked field by field. Then the objects must line up: selectors and pod
labels, named ports and probes, the ConfigMap key the proxy reads (loaded by the
proxy's own settings loader), the engine's headless Service and the URL the proxy
dials, the disruption budget and the replicas, and the init container that merges the
API keys Secret into the settings (run here on files), and the PostgreSQL Secret: its
keys optional in the base (no Batch API, a budget per replica without it), required by
overlays/postgres, where every replica's Batch API store and budget ledger are the one
PostgreSQL it names.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from proxy.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"
OVERLAYS = ("gpu", "laptop", "postgres")
ON_GPU = {"gpu", "postgres"}  # overlays/postgres is the gpu overlay and PostgreSQL
POSTGRES_SECRET = "whoseturn-postgres"
KUBERNETES = "1.30.0"
Object = dict[str, Any]


def render(directory: Path) -> list[Object]:
    """``kustomize build DIRECTORY`` for the subset of kustomize these files use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {
        "apiVersion",
        "kind",
        "resources",
        "patches",
        "labels",
        "images",
    }
    assert not unknown, f"{directory}: render() does not implement {unknown}"
    objects: list[Object] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matches = [
            o
            for o in objects
            if (o["kind"], o["metadata"]["name"]) == (target["kind"], target["name"])
        ]
        assert len(matches) == 1, f"{directory}: patch target {target}"
        for operation in yaml.safe_load(patch["patch"]):
            json_patch(matches[0], operation)
    for labels in kustomization.get("labels", []):
        for o in objects:
            o["metadata"].setdefault("labels", {}).update(labels["pairs"])
    for image in kustomization.get("images", []):
        for container in containers(objects):
            name, _, _ = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    return objects


def json_patch(document: Object, operation: dict[str, Any]) -> None:
    """One RFC 6902 ``add``, ``replace`` or ``remove`` (the ops the overlays use)."""
    *parents, last = [
        p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]
    ]
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = last
    if isinstance(node, list):
        key = len(node) if last == "-" else int(last)
    op = operation["op"]
    if op == "remove" or op == "replace":
        assert key in node if isinstance(node, dict) else key < len(node), operation
    if op == "remove":
        del node[key]
    elif op == "add" and isinstance(node, list):  # insert before the index (or append)
        assert key <= len(node), operation
        node.insert(key, copy.deepcopy(operation["value"]))
    elif op in {"add", "replace"}:
        node[key] = copy.deepcopy(operation["value"])
    else:
        raise AssertionError(f"unsupported op {op}")


def containers(objects: list[Object]) -> list[Object]:
    pods = [o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"]
    return [c for pod in pods for c in pod["containers"] + pod.get("initContainers", [])]


def one(objects: list[Object], kind: str, name: str) -> Object:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Object]]:
    return request.param, render(K8S / "overlays" / request.param)


def test_every_object_is_valid(overlay: tuple[str, list[Object]]) -> None:
    _, objects = overlay
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "PodMonitor", "Service"]
    for o in objects:
        if o["kind"] == "PodMonitor":
            assert o["apiVersion"] == "monitoring.coreos.com/v1"
            assert set(o["spec"]) == {"selector", "podMetricsEndpoints"}
            for endpoint in o["spec"]["podMetricsEndpoints"]:
                assert set(endpoint) <= {"port", "path", "interval"}
            continue
        kubernetes_validate.validate(o, KUBERNETES, strict=True)


def test_selectors_find_pods_and_named_ports(overlay: tuple[str, list[Object]]) -> None:
    _, objects = overlay
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    for d in deployments:
        assert selects(
            d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]
        )
    for o in objects:
        if o["kind"] in {"Service", "PodMonitor", "PodDisruptionBudget"}:
            selector = o["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            pods = [
                d
                for d in deployments
                if selects(selector, d["spec"]["template"]["metadata"]["labels"])
            ]
            assert len(pods) == 1, o["metadata"]["name"]
            ports = {
                p["name"]
                for c in pods[0]["spec"]["template"]["spec"]["containers"]
                for p in c["ports"]
            }
            wanted = [p["targetPort"] for p in o["spec"].get("ports", [])]
            wanted += [e["port"] for e in o["spec"].get("podMetricsEndpoints", [])]
            assert set(wanted) <= ports, o["metadata"]["name"]
    for c in containers(objects):
        named = {p["name"] for p in c.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["port"] in named, (c["name"], probe)


def test_proxy_replicas_probes_and_disruption_budget(overlay: tuple[str, list[Object]]) -> None:
    _, objects = overlay
    proxy = one(objects, "Deployment", "whoseturn")
    assert proxy["spec"]["replicas"] >= 2
    assert (
        one(objects, "PodDisruptionBudget", "whoseturn")["spec"]["minAvailable"]
        < proxy["spec"]["replicas"]
    )
    pod = proxy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0


def test_the_proxy_reads_its_configmap_and_dials_the_engine_service(
    overlay: tuple[str, list[Object]], tmp_path: Path
) -> None:
    _, objects = overlay
    pod = one(objects, "Deployment", "whoseturn")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_map = one(objects, "ConfigMap", volumes["config"]["configMap"]["name"])
    for item in volumes["config"]["configMap"]["items"]:
        assert item["key"] in config_map["data"]
    config = tmp_path / "whoseturn.yaml"
    config.write_text(config_map["data"]["whoseturn.yaml"])
    settings = load_settings(str(config), env={}, cwd=tmp_path)
    (container,) = pod["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [settings.serving.port]
    assert settings.serving.host == "0.0.0.0"
    service = one(objects, "Service", "whoseturn")
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    engine_service = one(objects, "Service", "vllm")
    assert engine_service["spec"]["clusterIP"] == "None"
    port = engine_service["spec"]["ports"][0]["port"]
    assert [e.url for e in settings.engines] == [f"dns+http://vllm:{port}"]
    engine = one(objects, "Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
    assert f"--port={port}" in engine["args"] or engine["args"][
        engine["args"].index("--port") + 1
    ] == str(port)


def test_init_container_merges_the_api_keys_secret(
    overlay: tuple[str, list[Object]], tmp_path: Path
) -> None:
    _, objects = overlay
    pod = one(objects, "Deployment", "whoseturn")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    secret = {v["name"]: v for v in pod["volumes"]}["api-keys"]["secret"]
    assert secret["secretName"] == "whoseturn-api-keys" and secret["optional"] is True
    config_map = one(objects, "ConfigMap", "whoseturn")
    for mount in ("config", "api-keys", "etc/whoseturn"):
        (tmp_path / mount).mkdir(parents=True)
    (tmp_path / "config/whoseturn.yaml").write_text(config_map["data"]["whoseturn.yaml"])
    script = init["command"][2]
    for path in ("/config", "/api-keys", "/etc/whoseturn"):
        script = script.replace(f'"{path}/', f'"{tmp_path}{path}/')
    merged = tmp_path / "etc/whoseturn/whoseturn.yaml"
    exec(script, {})  # no Secret: the settings as they are
    assert load_settings(str(merged), env={}, cwd=tmp_path).access.api_keys == ()
    (tmp_path / "api-keys/api_keys.yaml").write_text("- key-one\n- key-two\n")
    exec(script, {})
    keys = load_settings(str(merged), env={}, cwd=tmp_path).access.api_keys
    assert list(keys) == ["key-one", "key-two"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert Path(env["WHOSETURN_CONFIG"]).parent.as_posix() in {
        m["mountPath"] for m in container["volumeMounts"]
    }


def test_engines_per_overlay(overlay: tuple[str, list[Object]]) -> None:
    name, objects = overlay
    (engine,) = one(objects, "Deployment", "vllm")["spec"]["template"]["spec"]["containers"]
    gpus = engine["resources"].get("limits", {}).get("nvidia.com/gpu")
    if name in ON_GPU:
        assert engine["image"].startswith("vllm/vllm-openai:") and gpus == "1"
    else:
        assert engine["image"] == "whoseturn:0.1.0" and gpus is None
        assert engine["args"][:3] == ["sim", "--profile", "cpu-tiny"]
    for c in containers(objects):
        assert ":" in c["image"], c["name"]


def pod_env(container: Object, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet gives it, from these Secrets."""
    env = {}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        ref = entry["valueFrom"]["secretKeyRef"]
        value = secrets.get(ref["name"], {}).get(ref["key"])
        if value is not None:
            env[entry["name"]] = value
        else:  # a missing optional key leaves the variable out; a required one stops the pod
            assert ref["optional"] is True, f"{entry['name']}: {ref} is required"
    return env


def proxy_settings(objects: list[Object], env: dict[str, str], tmp_path: Path) -> Any:
    config = tmp_path / "whoseturn.yaml"
    config.write_text(one(objects, "ConfigMap", "whoseturn")["data"]["whoseturn.yaml"])
    return load_settings(str(config), env=env, cwd=tmp_path)


def test_postgres_dsns_come_from_one_secret_with_optional_keys_in_the_base(
    overlay: tuple[str, list[Object]],
) -> None:
    name, objects = overlay
    (container,) = one(objects, "Deployment", "whoseturn")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    for variable, key in (
        ("WHOSETURN_LEDGER_DSN", "ledger_dsn"),
        ("WHOSETURN_BATCH_DSN", "batch_dsn"),
    ):
        ref = env[variable]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": POSTGRES_SECRET, "key": key, "optional": name != "postgres"}


def test_without_the_secret_the_batch_api_is_off_and_each_replica_keeps_its_budget(
    overlay: tuple[str, list[Object]], tmp_path: Path
) -> None:
    name, objects = overlay
    if name == "postgres":
        (container,) = one(objects, "Deployment", "whoseturn")["spec"]["template"]["spec"][
            "containers"
        ]
        with pytest.raises(AssertionError, match="is required"):
            pod_env(container, {})
        return
    (container,) = one(objects, "Deployment", "whoseturn")["spec"]["template"]["spec"]["containers"]
    settings = proxy_settings(objects, pod_env(container, {}), tmp_path)
    assert (settings.replicas.ledger_dsn, settings.batch.dsn, settings.batch.on) == ("", "", False)


def test_with_the_secret_every_replica_shares_jobs_and_budget_through_postgres(
    overlay: tuple[str, list[Object]], tmp_path: Path
) -> None:
    name, objects = overlay
    proxy = one(objects, "Deployment", "whoseturn")
    assert proxy["spec"]["replicas"] >= 2  # one pod template: every replica reads the same
    (container,) = proxy["spec"]["template"]["spec"]["containers"]
    dsn = "postgresql://whoseturn:secret@postgres:5432/whoseturn"
    secret = {POSTGRES_SECRET: {"ledger_dsn": dsn, "batch_dsn": dsn}}
    settings = proxy_settings(objects, pod_env(container, secret), tmp_path)
    assert settings.replicas.ledger_dsn == dsn  # the shared budget, in every overlay
    if name == "postgres":  # the Batch API on, its store shared
        assert (settings.batch.store, settings.batch.dsn) == ("postgres", dsn)
    else:
        assert settings.batch.store == "off" and not settings.batch.on
