"""``dashboards/whoseturn.json`` read through Grafana's own dashboard model, offline.

Grafana publishes its dashboard schema as typed models in PyPI's
``grafana-foundation-sdk`` (generated from Grafana's CUE schemas, with a model for each
core panel plugin and data source query). The dashboard is decoded into those models
and encoded back: every key must come back with the same value (a key the model does
not know, such as a misspelt field or an option of another panel type, is dropped and
fails the test, except the few Grafana writes itself that the model leaves out, listed
in ``NOT_MODELLED``); every decoded value must have the type its model field declares
(a string where Grafana wants a number, an unknown enum value); every panel must be of
a type Grafana ships, have a grid position on the 24-column grid, and take its data
from the dashboard's ``datasource`` variable. The provisioning files under
``deploy/compose/grafana/`` are then checked against that variable: the provisioned
data source is of the type the variable lists, and the dashboard provider loads the
folder the compose file mounts ``dashboards/`` at.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog import plugins, runtime
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards/whoseturn.json"
COMPOSE_DIR = ROOT / "deploy/compose"
GRID_COLUMNS = 24
VARIABLE_UID = "${datasource}"

# Keys Grafana writes into exported dashboards that the SDK's model has no field for.
NOT_MODELLED = {
    ("__requires",),
    ("id",),
    ("annotations", "list", "*", "builtIn"),
    ("templating", "list", "*", "definition"),
    ("panels", "*", "options", "wideLayout"),  # stat: newer than the SDK's stat model
}


def load() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


@pytest.fixture(scope="module")
def model() -> Dashboard:
    plugins.register_default_plugins()
    return Dashboard.from_json(load())


def lost_or_changed(source: Any, back: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Where ``back`` (the model's encoding) lost a key of ``source`` or changed a value."""
    problems = []
    if isinstance(source, dict) and isinstance(back, dict):
        for key, value in source.items():
            here = (*path, key)
            if key not in back:
                generic = tuple("*" if p.isdigit() else p for p in here)
                if generic not in NOT_MODELLED:
                    problems.append("/".join(here) + ": not in Grafana's model")
            else:
                problems += lost_or_changed(value, back[key], here)
    elif isinstance(source, list) and isinstance(back, list) and len(source) == len(back):
        for i, (a, b) in enumerate(zip(source, back, strict=True)):
            problems += lost_or_changed(a, b, (*path, str(i)))
    elif source != back or type(source) is not type(back):
        problems.append(f"{'/'.join(path)}: {source!r} came back as {back!r}")
    return problems


def type_errors(value: Any, path: str = "dashboard") -> list[str]:
    """Each model field of ``value`` (recursively) checked against its declared type."""
    cls = type(value)
    if not cls.__module__.startswith("grafana_foundation_sdk.models"):
        return []
    hints = typing.get_type_hints(cls.__init__)
    problems = []
    for name, hint in hints.items():
        if name == "return" or not hasattr(value, name):
            continue
        problems += check(getattr(value, name), hint, f"{path}.{name}")
    return problems


def check(value: Any, hint: Any, path: str) -> list[str]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is object or hint is Any:
        return type_errors(value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return []
        results = [check(value, a, path) for a in args if a is not type(None)]
        return [] if any(not r for r in results) else results[0]
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} is not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {value!r} is not a list"]
        return [p for i, v in enumerate(value) for p in check(v, args[0], f"{path}[{i}]")]
    if origin is dict:
        return [] if isinstance(value, dict) else [f"{path}: {value!r} is not an object"]
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return [] if ok else [f"{path}: {value!r} is not a number"]
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"{path}: {value!r} is not an integer"]
    if isinstance(hint, type):
        if issubclass(hint, enum.Enum):  # the model keeps the JSON value
            allowed = [m.value for m in hint]
            ok = isinstance(value, hint) or (value in allowed and type(value) is type(allowed[0]))
            return [] if ok else [f"{path}: {value!r} is not one of {allowed}"]
        if not isinstance(value, hint):
            return [f"{path}: {value!r} is not a {hint.__name__}"]
        return type_errors(value, path)
    return []


def test_every_key_survives_grafanas_model(model: Dashboard) -> None:
    back = json.loads(json.dumps(model, cls=JSONEncoder))
    assert lost_or_changed(load(), back) == []


def test_every_value_has_the_type_grafanas_model_declares(model: Dashboard) -> None:
    assert type_errors(model) == []


def panels(model: Dashboard) -> list[Panel]:
    out: list[Panel] = []
    for panel in model.panels or []:
        if isinstance(panel, RowPanel):
            out += [p for p in panel.panels or [] if isinstance(p, Panel)]
        else:
            out.append(panel)
    return out


def test_panels_are_grafana_panel_types_on_the_grid(model: Dashboard) -> None:
    found = panels(model)
    assert found
    for panel in found:
        assert runtime.panelcfg_config(panel.type_val) is not None, panel.title
        grid = panel.grid_pos
        assert grid is not None, panel.title
        assert grid.w > 0 and grid.h > 0 and grid.x + grid.w <= GRID_COLUMNS, panel.title
    ids = [p.id_val for p in found]
    assert len(set(ids)) == len(ids), "panel ids repeat"


def test_panels_and_queries_use_the_datasource_variable(model: Dashboard) -> None:
    for panel in panels(model):
        assert panel.datasource is not None, panel.title
        assert (panel.datasource.type_val, panel.datasource.uid) == (
            "prometheus",
            VARIABLE_UID,
        ), panel.title
        assert panel.targets, panel.title
        for target in panel.targets:
            as_json = json.loads(json.dumps(target, cls=JSONEncoder))
            assert as_json["datasource"] == {"type": "prometheus", "uid": VARIABLE_UID}
            assert type(target).__module__.endswith(".prometheus"), panel.title
            assert as_json["expr"], panel.title


def test_provisioning_loads_the_dashboard_and_its_datasource() -> None:
    dashboard = load()
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource"
    sources = yaml.safe_load(
        (COMPOSE_DIR / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    (source,) = sources["datasources"]
    assert source["type"] == variable["query"]  # the variable lists this data source
    assert source["isDefault"] is True  # so the variable's first value is this one
    required = {(r["type"], r["id"]) for r in dashboard["__requires"]}
    assert ("datasource", source["type"]) in required
    compose = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    grafana = compose["services"]["grafana"]
    bound = {
        v.split(":")[1]: (COMPOSE_DIR / v.split(":")[0]).resolve()
        for v in grafana["volumes"]
        if v.startswith(".")
    }
    providers = yaml.safe_load(
        (COMPOSE_DIR / "grafana/provisioning/dashboards/whoseturn.yaml").read_text()
    )
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    folder = bound[provider["options"]["path"]]
    assert (folder / DASHBOARD.name).read_text() == DASHBOARD.read_text()
    for kind in ("datasources", "dashboards"):
        mounted = bound[str(PurePosixPath("/etc/grafana/provisioning") / kind)]
        assert mounted == COMPOSE_DIR / "grafana/provisioning" / kind
        assert list(mounted.glob("*.yaml")), kind
