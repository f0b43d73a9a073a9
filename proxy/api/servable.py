"""Whether a request's model can be served now, and an honest answer when not.

- A model no engine is known to serve is a 404 listing the models served (the
  client's fix is most often a typo), unless some engine's models are not known
  (it was unreachable when the proxy started): then nobody can say the model does
  not exist, and the answer is 503 naming those engines and why, and the models
  served so far.
- A draining proxy (after SIGTERM) starts nothing: 503 with ``Retry-After``.
- A known model whose engines are all down is a 503 naming them and why, for
  interactive requests (they do not wait), unless one of them is asleep on a card
  (:mod:`proxy.cards`): the request waits for its wake. Batch requests wait in
  the queue for an engine to come back.
"""

from __future__ import annotations

import math

from proxy.admission import Admission
from proxy.engines import EngineMonitor
from proxy.openai.errors import APIError, engine_unavailable, model_not_found, models_served
from proxy.scheduler import TrafficClass


def unservable(
    model: str, cls: TrafficClass, admission: Admission, monitor: EngineMonitor
) -> APIError | None:
    """The error to answer for a request for ``model`` of class ``cls``, or ``None``
    if it may go on (see the module docstring)."""
    retry_after = max(1, math.ceil(monitor.settings.upstream.health_interval_s))
    if admission.closed:
        return shutting_down()
    served = admission.models()
    if model not in served:
        unknown = admission.engines_without_models()
        if not unknown:
            return model_not_found(model, served)
        message = (
            f"The model `{model}` is not served by any engine the proxy has reached; "
            f"engines whose models are not known yet: {_why(unknown, monitor)}. "
            + models_served(served)
        )
        return engine_unavailable(message, retry_after)
    if (
        cls is TrafficClass.INTERACTIVE
        and not admission.engines_up_for(model)
        and not admission.resting_for(model)
    ):
        engines = _why(admission.engines_for(model), monitor)
        return engine_unavailable(f"No engine serving `{model}` is up: {engines}.", retry_after)
    return None


def shutting_down() -> APIError:
    """The answer to a request the draining proxy will not start."""
    message = "The proxy is shutting down; retry on another replica."
    return engine_unavailable(message, 1, code="shutting_down")


def _why(names: list[str], monitor: EngineMonitor) -> str:
    return "; ".join(f"{name} ({monitor.why_unusable(name)})" for name in names)
