"""Measuring an OpenAI-compatible engine from outside, over HTTP: what the probe, the
simulator's calibration and the load client share.

- :mod:`.info`: what the engine serves (:class:`EngineInfo`, :func:`engine_info`),
  and :class:`EngineIOError`, raised for any answer a measurement cannot use;
- :mod:`.prompts`: prompts of an exact number of the engine's own tokens
  (:class:`PromptMaker`, through ``/tokenize``), unique from their first token on;
- :mod:`.sse`: the one reader of server-sent events (:func:`sse_events`);
- :mod:`.tokens`: the arrival times of a stream's tokens (:class:`TokenLog`,
  :func:`record_tokens`);
- :mod:`.metrics`: a Prometheus exposition's samples (:func:`samples`,
  :func:`labelled_samples`).

The only I/O is the ``httpx.AsyncClient`` (or response) a caller hands in. Nothing
here is shared with the proxy's own relay code: the bench measures the system under
test and shares no code with it.
"""

from loadtests.engine_io.info import EngineInfo, EngineIOError, check_status, engine_info
from loadtests.engine_io.metrics import labelled_samples, samples
from loadtests.engine_io.prompts import PromptMaker
from loadtests.engine_io.sse import sse_events
from loadtests.engine_io.tokens import TokenLog, record_tokens

__all__ = [
    "EngineIOError",
    "EngineInfo",
    "PromptMaker",
    "TokenLog",
    "check_status",
    "engine_info",
    "labelled_samples",
    "record_tokens",
    "samples",
    "sse_events",
]
