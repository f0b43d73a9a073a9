"""A request's use of its tenant's limits and its per-tenant metrics, from the
moment the request path takes it (a client's at the HTTP edge, a batch line's in
:meth:`proxy.api.forward.Forwarder.complete`) to its end.

- :func:`refuse_over_limit`: before a client's request is queued, its tenant's
  limits (:class:`proxy.scheduler.limits.TenantMeter`): over one, 429 with
  ``Retry-After`` and OpenAI's error shape (``code: rate_limit_exceeded``). A batch
  line is not refused here: the batch runner holds it instead.
- :class:`Metered`: the request counted as it starts (its prompt tokens, one in
  flight) and as it ends (its completion tokens), once, whichever way it ends; and
  its tenant's metrics: one ``request`` (at its first token, or its end without
  one) and its ``tokens`` (at its end, where the engine said them).
"""

from __future__ import annotations

import logging

from proxy.metrics import ProxyMetrics
from proxy.openai.errors import APIError
from proxy.openai.request import ChatRequest
from proxy.scheduler.limits import Refusal, TenantMeter

logger = logging.getLogger(__name__)


def rate_limited(refusal: Refusal) -> APIError:
    """The 429 of a refusal: ``Retry-After`` in whole seconds (at least 1), the
    error naming the tenant and the limit."""
    return APIError(
        429,
        refusal.message(),
        err_type=refusal.kind,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(refusal.retry_after)},
    )


def refuse_over_limit(
    meter: TenantMeter | None, metrics: ProxyMetrics, req: ChatRequest, prompt_tokens: int
) -> None:
    """Raise the 429 for ``req`` (of ``prompt_tokens`` as counted) if its tenant is
    over a limit now; the refusal is counted in the tenant's metrics."""
    if meter is None:
        return
    refusal = meter.check(req.tenant, prompt_tokens)
    if refusal is None:
        return
    metrics.tenants.limited(req.tenant.name, refusal.limit)
    logger.info(
        "tenant %s: %s request refused, %s %d (used %d); retry after %d s",
        req.tenant.name,
        req.cls.value,
        refusal.limit,
        refusal.allowed,
        refusal.used,
        refusal.retry_after,
    )
    raise rate_limited(refusal)


class Metered:
    """One request counted against its tenant (see the module docstring). Made as
    the request starts; :meth:`end` may be called more than once (the relay's end
    and the request path's last resort), and counts once."""

    def __init__(
        self,
        meter: TenantMeter | None,
        metrics: ProxyMetrics,
        req: ChatRequest,
        arrival: float,
        prompt_tokens: int,
    ) -> None:
        self.meter = meter
        self.metrics = metrics
        self.req = req
        self.arrival = arrival
        self._reported = False
        self._ended = False
        if meter is not None:
            meter.started(req.tenant, prompt_tokens)

    def first_token(self, waited_s: float, ttft_s: float) -> None:
        """Its first token came ``ttft_s`` after its arrival; it had waited
        ``waited_s`` in the proxy's queue."""
        if self._reported:
            return
        self._reported = True
        req = self.req
        self.metrics.tenants.request(req.tenant.name, req.cls, waited_s=waited_s, ttft_s=ttft_s)

    def end(
        self, now: float, usage: tuple[int, int] | None = None, waited_s: float | None = None
    ) -> None:
        """It ended at ``now``: ``usage`` (prompt, completion tokens) where the engine
        said them; ``waited_s`` its wait in the queue where it was admitted (else its
        whole time in the proxy)."""
        if self._ended:
            return
        self._ended = True
        req = self.req
        if self.meter is not None:
            self.meter.finished(req.tenant, usage[1] if usage is not None else 0)
        if usage is not None:
            self.metrics.tenants.tokens(req.tenant.name, req.cls, usage[0], usage[1])
        if not self._reported:
            self._reported = True
            waited = now - self.arrival if waited_s is None else waited_s
            self.metrics.tenants.request(req.tenant.name, req.cls, waited_s=waited, ttft_s=None)
