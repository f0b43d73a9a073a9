"""Per-tenant figures: what each tenant of a workload (``tenants:`` in the workload
file) sent and got, so a report can say whether one tenant's traffic crowded out
another's.

A tenant's row pools every class it sends, over the runs given: its requests sent
after each run's warm-up (streams the client closed at the run's end left out, as in
the class figures), their TTFT p50 and p95, and the tokens of their answers as the
usage counts them (prompt + completion); a ``batch-api`` class adds the lines and
tokens of its jobs submitted after the warm-up (no TTFT: a job streams nothing).
``share`` is the tenant's part of all tenants' tokens in those runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loadtests.harness.measures import pct

if TYPE_CHECKING:
    from loadtests.harness.traffic import ArmRun
    from loadtests.harness.workload_file import Workload

NO_TENANT = "(no key)"
"""How a report names the top-level classes' requests, which carry no key."""


@dataclass(frozen=True)
class TenantSummary:
    """One tenant over the measured windows of some runs (seconds, counts)."""

    tenant: str
    requests: int
    ttft_p50: float
    ttft_p95: float
    tokens: int
    share: float  # of all tenants' tokens (0..1); NaN when no tenant has any

    @property
    def label(self) -> str:
        return self.tenant or NO_TENANT


def summarize_tenants(workload: Workload, runs: list[ArmRun]) -> list[TenantSummary]:
    """A row per tenant of ``workload`` (:meth:`Workload.tenant_names`, in order) over
    ``runs``."""
    requests = {t: 0 for t in workload.tenant_names()}
    tokens = dict.fromkeys(requests, 0)
    ttft: dict[str, list[float]] = {t: [] for t in requests}
    for run in runs:
        start, end = run.window(workload)
        for cls in workload.classes:
            for r in run.records.get(cls.name, []):
                if not start <= r.sent_at <= end or r.closed_at is not None:
                    continue
                requests[cls.tenant] += 1
                tokens[cls.tenant] += r.tokens or 0
                if (t := r.ttft) is not None:
                    ttft[cls.tenant].append(t)
            for job in run.jobs.get(cls.name, []):
                if start <= job.submitted_at <= end:
                    requests[cls.tenant] += job.lines
                    tokens[cls.tenant] += job.tokens
    total = sum(tokens.values())
    return [
        TenantSummary(
            tenant=t,
            requests=requests[t],
            ttft_p50=pct(ttft[t], 0.50),
            ttft_p95=pct(ttft[t], 0.95),
            tokens=tokens[t],
            share=tokens[t] / total if total else math.nan,
        )
        for t in requests
    ]
