"""Every metric the proxy exports is declared in ``proxy/metrics.py``, and exported
in the order docs/metrics.md lists it, with the labels it lists."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.metrics import Deadline, ProxyMetrics
from proxy.scheduler import Job, Scheduler, TrafficClass

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"`(whoseturn_\w+)(?:\{([^}]*)\})?`")
DECLARE = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "Collector", "Metric"}
ONLY_WITH_A_LEDGER = {
    "whoseturn_ledger_up",
    "whoseturn_ledger_outages_total",
    "whoseturn_ledger_local_reservations_total",
}
ONLY_WITH_BATCH = {
    "whoseturn_batch_jobs",
    "whoseturn_batch_store_up",
    "whoseturn_batch_store_outages_total",
    "whoseturn_batch_tokens_total",
    "whoseturn_batch_estimated_completion_timestamp_seconds",
    "whoseturn_batch_expires_timestamp_seconds",
}
ONLY_WITH_A_CARD = {
    "whoseturn_model_awake",
    "whoseturn_card_swapping",
    "whoseturn_model_swaps_total",
    "whoseturn_model_swap_failures_total",
    "whoseturn_model_swap_seconds",
    "whoseturn_activation_wait_seconds",
}


def documented() -> list[tuple[str, frozenset[str]]]:
    """docs/metrics.md's rows in order: each metric's name and labels (a row may
    name two)."""
    out = []
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("| `whoseturn_"):
            cell = line.split("|")[1]
            for name, labels in ROW.findall(cell):
                out.append((name, frozenset(filter(None, labels.split(",")))))
    return out


def exported(metrics: ProxyMetrics) -> list[tuple[str, frozenset[str]]]:
    """The registry's families in the order ``/metrics`` writes them, with the
    labels of their samples (a histogram's ``le`` aside)."""
    out = []
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        out.append((name, frozenset(k for s in family.samples for k in s.labels if k != "le")))
    return out


@dataclass
class Ledger:
    up: bool = True
    outages: int = 0
    local_grants: int = 0


@dataclass
class Store:
    up: bool = True
    outages: int = 0


@dataclass
class Card:
    """What the card families read (:class:`proxy.metrics.CardReads`): model ``m``
    awake on engine ``a``, ``n`` asleep on ``b``, no swap running."""

    name: str = "card-0"
    swapping: bool = False

    def awake_by_model(self) -> dict[str, tuple[str, bool]]:
        return {"m": ("a", True), "n": ("b", False)}


CONFIG = EngineConfig(name="a", url="http://a:8000", models=frozenset({"m"}))


def proxy_metrics(scheduler: Scheduler | None = None) -> ProxyMetrics:
    scheduler = scheduler if scheduler is not None else Scheduler([CONFIG], VirtualClock())
    return ProxyMetrics(scheduler, 0.3, 0.1, {"a": CONFIG.url}, tenant_names=("team-a",))


def every_family_fed() -> ProxyMetrics:
    """Metrics with a ledger, batch on, one engine piecing, one of each
    request-path observation, chats of two tenants queued (so the fairness index
    is judged), and a card with a model woken and a request that waited for it, so
    every family has a sample."""
    scheduler = Scheduler([CONFIG], VirtualClock())
    for tenant in ("team-a", "team-b"):
        scheduler.submit(
            Job(
                id=tenant,
                cls=TrafficClass.INTERACTIVE,
                model="m",
                prompt_tokens=10,
                arrival=0.0,
                tenant=tenant,
            )
        )
    metrics = proxy_metrics(scheduler)
    metrics.ledger.attach(Ledger())
    metrics.batch.attach(Store(), lambda: [Deadline("batch_1", 200.0, 100.0)])
    metrics.batch.set_jobs({"in_progress": 1})
    metrics.pieces.add("a")
    metrics.queue_wait.labels("interactive").observe(0.01)
    for histogram in (metrics.ttft, metrics.prefill, metrics.inter_token, metrics.request):
        histogram.labels("interactive", "a").observe(0.01)
    metrics.tenants.request("team-a", TrafficClass.INTERACTIVE, waited_s=0.01, ttft_s=0.02)
    metrics.cards.attach(Card())
    metrics.cards.step_seconds.labels("card-0", "m", "wake").observe(5.0)
    metrics.cards.activation_wait.labels("interactive", "m").observe(5.0)
    return metrics


def test_the_exported_families_are_the_documented_ones_in_their_order() -> None:
    metrics = every_family_fed()
    empty = [f.name for f in metrics.registry.collect() if not f.samples]
    assert empty == [], "each family has a sample to read its labels from"
    assert exported(metrics) == documented()


def test_ledger_batch_and_card_families_wait_for_what_they_read() -> None:
    """One replica alone, batch off, no card: no ledger family, no batch family but
    the records counter, no card family."""
    names = [name for name, _ in exported(proxy_metrics())]
    docs = [name for name, _ in documented()]
    waiting = ONLY_WITH_A_LEDGER | ONLY_WITH_BATCH | ONLY_WITH_A_CARD
    assert names == [n for n in docs if n not in waiting]
    assert "whoseturn_batch_records_total" in names


def test_no_module_but_proxy_metrics_declares_a_metric() -> None:
    found = []
    for path in sorted((ROOT / "proxy").rglob("*.py")):
        if path == ROOT / "proxy" / "metrics.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("prometheus_client")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "prometheus_client"
            ):
                names = [
                    a.name for a in node.names if a.name in DECLARE or a.name.endswith("Family")
                ]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names]
    assert found == []
