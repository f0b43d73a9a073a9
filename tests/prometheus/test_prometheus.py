"""The dashboard and the Prometheus rules, against a real Prometheus.

Every PromQL expression of ``dashboards/whoseturn.json`` and of
``deploy/prometheus/rules.yml`` is run on a Prometheus that has scraped the proxy and
a simulated engine under mixed chat and batch load (fixtures in ``conftest.py``):
each one must parse, and each dashboard and recording-rule expression must return
data, except the few listed in :data:`NO_DATA` with the reason. Alert expressions
need only parse: a healthy run fires nothing. ``promtool`` checks the rules and the
example configuration and runs the alerts' unit tests (``rules_test.yml``).

Grafana's variables are substituted as a user would set them: ``$engine`` and
``$model`` to the one value their ``label_values`` query offers (a concrete value,
so that a filter on a label the series lack returns nothing instead of matching
everything), ``$__rate_interval`` to 10s (four scrapes at the test's 1 s interval).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from proxy.config import Settings
from proxy.metrics import TTFT_BUCKETS
from proxy.scheduler import Turn

from .conftest import (
    DASHBOARD,
    ENGINE,
    EXAMPLE_CONFIG,
    MODEL,
    ROOT,
    RULES,
    RULES_TEST,
    SECOND_ENGINE,
    Live,
    tool,
)

pytestmark = pytest.mark.prometheus

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
BUILTIN_VARIABLES = {"__rate_interval": "10s", "__interval": "2s", "__range": "1m"}


@dataclass(frozen=True)
class Expr:
    source: str  # dashboard, record or alert
    name: str
    expr: str

    @property
    def id(self) -> str:
        return f"{self.source}: {self.name}"


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside (collapsed) rows."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def dashboard_expressions() -> list[Expr]:
    return [
        Expr("dashboard", f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in panels(load_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def rule_expressions() -> list[Expr]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [
        Expr("record", rule["record"], rule["expr"])
        if "record" in rule
        else Expr("alert", rule["alert"], rule["expr"])
        for group in groups
        for rule in group["rules"]
    ]


EXPRESSIONS = dashboard_expressions() + rule_expressions()

# Expressions allowed to return nothing in this test, with the reason. Each must
# still parse; one that starts returning data must leave this list.
NO_DATA: dict[str, str] = {}

VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
LABEL_VALUES = re.compile(r"^label_values\(\s*([^,\s]+)\s*,\s*(\w+)\s*\)$")


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana's ``$name`` / ``${name}`` / ``${name:fmt}`` replaced."""

    def one(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name not in values:
            raise AssertionError(f"no test value for the dashboard variable ${name} in {expr!r}")
        return values[name]

    return VARIABLE.sub(one, expr)


def query_variables() -> list[dict[str, Any]]:
    variables: list[dict[str, Any]] = load_dashboard()["templating"]["list"]
    return [v for v in variables if v["type"] == "query"]


@pytest.fixture(scope="module")
def variables(live: Live) -> dict[str, str]:
    """Each query variable set to the value its ``label_values`` offers (``$engine``:
    the load's engine, of the two on its card)."""
    values = dict(BUILTIN_VARIABLES)
    for variable in query_variables():
        match = LABEL_VALUES.match(variable["query"])
        assert match, f"${variable['name']}: not a label_values() query: {variable['query']}"
        offered = live.prometheus.label_values(match[1], match[2])
        if variable["name"] == "engine":
            assert sorted(offered) == [ENGINE, SECOND_ENGINE], f"$engine offers {offered}"
            offered = [ENGINE]
        assert len(offered) == 1, f"${variable['name']} offers {offered}"
        values[variable["name"]] = offered[0]
    return values


# -- promtool -------------------------------------------------------------------------


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


@pytest.mark.parametrize(
    "args",
    [
        ("check", "rules", str(RULES)),
        ("check", "config", str(EXAMPLE_CONFIG)),
        ("test", "rules", str(RULES_TEST)),
    ],
    ids=["check rules", "check example config", "alert unit tests"],
)
def test_promtool(args: tuple[str, ...]) -> None:
    done = promtool(*args)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


# -- the dashboard, statically ---------------------------------------------------------


def test_dashboard_is_grafana_json_on_a_datasource_variable() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["engine"]["query"] == "label_values(whoseturn_turn, engine)"
    assert variables["model"]["query"] == "label_values(vllm:num_requests_running, model_name)"
    ids = [p["id"] for p in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard["panels"]):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_the_turn_is_a_state_timeline_with_every_turn_mapped() -> None:
    timelines = [
        p
        for p in panels(load_dashboard()["panels"])
        if p["type"] == "state-timeline" and "whoseturn_turn{" in p["targets"][0]["expr"]
    ]
    assert timelines, "no state timeline on whoseturn_turn"
    for panel in timelines:
        mapped = {
            option["text"]
            for mapping in panel["fieldConfig"]["defaults"]["mappings"]
            for option in mapping["options"].values()
        }
        assert mapped == {t.value for t in Turn}
        for turn in Turn:
            assert f'turn="{turn.value}"' in panel["targets"][0]["expr"]


def test_recorded_series_the_dashboard_reads_are_recorded() -> None:
    recorded = {e.name for e in rule_expressions() if e.source == "record"}
    used = {
        name
        for e in dashboard_expressions()
        for name in re.findall(r"whoseturn:[a-z0-9_:]+", e.expr)
    }
    assert used, "the dashboard reads no recorded series"
    assert used <= recorded, f"not recorded by rules.yml: {sorted(used - recorded)}"


def test_the_ttft_slo_threshold_is_a_bucket_bound_and_the_default_target() -> None:
    bounds = set(re.findall(r'whoseturn_ttft_seconds_bucket\{[^}]*le="([^"]+)"', RULES.read_text()))
    assert bounds == {"0.3"}
    default = Settings(engines=()).serving.ttft_target_s
    assert 0.3 in TTFT_BUCKETS
    assert default == 0.3


def test_no_data_lists_only_real_expressions() -> None:
    assert set(NO_DATA) <= {e.id for e in EXPRESSIONS}


def test_no_data_expressions_read_documented_families() -> None:
    """What the live check cannot see: an expression let off returning data still
    names families the proxy exports (docs/metrics.md, held to the registry by
    ``tests/unit/test_metrics_docs.py``), so a misspelt name is caught here."""
    documented = set(re.findall(r"`(whoseturn_\w+)", (ROOT / "docs/metrics.md").read_text()))
    for item in EXPRESSIONS:
        if item.id not in NO_DATA:
            continue
        names = {
            re.sub(r"_(bucket|count|sum)$", "", name)
            for name in re.findall(r"\bwhoseturn_\w+", item.expr)
        }
        assert names, item.id
        assert names <= documented, f"{item.id}: not in docs/metrics.md: {names - documented}"


# -- against the live Prometheus -----------------------------------------------------


@pytest.mark.timeout(120)
def test_the_load_was_mixed_and_scraped(live: Live) -> None:
    ok = f'whoseturn_requests_total{{outcome="ok", engine="{ENGINE}"}}'
    served = live.prometheus.result(f"sum by (class) ({ok})")
    assert {r["metric"]["class"]: float(r["value"][1]) > 0 for r in served} == {
        "interactive": True,
        "batch": True,
    }
    steps = live.prometheus.result(
        f'sum(vllm:iteration_tokens_total_count{{model_name="{MODEL}"}})'
    )
    assert float(steps[0]["value"][1]) > 0


@pytest.mark.timeout(120)
def test_the_prefix_cache_panels_have_hits_to_show(live: Live) -> None:
    """The batch prompts' shared document: the engine reported part of their prompt
    tokens cached, the proxy's index (kept from what it routed) expected some of
    them, and holds blocks; both reasons for a route have a series."""

    def value(expr: str) -> float:
        (sample,) = live.prometheus.result(expr)
        return float(sample["value"][1])

    cached = f'whoseturn_prefix_cached_tokens_total{{engine="{ENGINE}", source="%s"}}'
    prompt = value(f'whoseturn_prefix_prompt_tokens_total{{engine="{ENGINE}"}}')
    reported, expected = value(cached % "reported"), value(cached % "expected")
    assert 0 < reported < prompt, (reported, prompt)
    assert 0 < expected < prompt, (expected, prompt)
    blocks = live.prometheus.result(f'whoseturn_prefix_index_blocks{{engine="{ENGINE}"}}')
    assert [(b["metric"]["mode"], float(b["value"][1]) > 0) for b in blocks] == [("routed", True)]
    routes = live.prometheus.result("whoseturn_route_decisions_total")
    assert sorted(r["metric"]["why"] for r in routes) == ["load", "prefix"]


@pytest.mark.timeout(120)
def test_dashboard_variables_offer_the_servers(live: Live, variables: dict[str, str]) -> None:
    # (the variable offers both engines of the card; the load's is chosen)
    assert variables["engine"] == ENGINE
    assert variables["model"] == MODEL


@pytest.mark.timeout(120)
@pytest.mark.parametrize("item", EXPRESSIONS, ids=lambda e: e.id)
def test_expression_parses_and_returns_data(
    live: Live, variables: dict[str, str], item: Expr
) -> None:
    expr = substitute(item.expr, variables)
    body = live.prometheus.query(expr)
    assert body["status"] == "success", f"{item.id}: {expr!r} does not run: {body.get('error')}"
    result = body["data"]["result"]
    if item.source != "alert" and item.id not in NO_DATA:
        deadline = time.monotonic() + 10  # a rule evaluated a moment late
        while not result and time.monotonic() < deadline:
            time.sleep(0.5)
            result = live.prometheus.result(expr)
    live.checked[item.id] = {"expr": expr, "series": len(result), "sample": result[:1]}
    if item.source == "alert":
        return
    if item.id in NO_DATA:
        assert not result, f"{item.id} returns data now: take it off NO_DATA"
    else:
        assert result, f"{item.id}: {expr!r} returned no data"
