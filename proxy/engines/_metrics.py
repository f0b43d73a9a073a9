"""An engine's load, read from its Prometheus ``/metrics`` text.

vLLM V1 exposes one sample per label set (``model_name``, ``engine`` — one per
data-parallel rank). Request counts are summed over label sets. KV-cache usage is
a fraction per rank, so the largest one is taken: summing two ranks at 0.6 would
claim a cache that is 120 % full. A series that is missing counts as 0; so does a
sample that is not a finite number. ``vllm:gpu_cache_usage_perc`` (vLLM V0) is read
when ``vllm:kv_cache_usage_perc`` is absent.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from proxy.scheduler import EngineLoad

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_V0 = "vllm:gpu_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
_WANTED = frozenset({KV_USAGE, KV_USAGE_V0, WAITING, RUNNING})


class MetricsParseError(ValueError):
    """The text is not a Prometheus exposition."""


def samples(text: str) -> dict[str, list[float]]:
    """The finite values of the wanted series, by sample name."""
    found: dict[str, list[float]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in _WANTED and math.isfinite(sample.value):
                    found[sample.name].append(sample.value)
    except (ValueError, IndexError, TypeError) as exc:
        raise MetricsParseError(str(exc) or type(exc).__name__) from exc
    return found


def parse_load(text: str) -> EngineLoad:
    """The :class:`EngineLoad` that a ``/metrics`` text describes.

    Raises :class:`MetricsParseError` if the text cannot be parsed.
    """
    found = samples(text)
    kv = found.get(KV_USAGE) or found.get(KV_USAGE_V0) or [0.0]
    return EngineLoad(
        kv_usage=max(kv),
        waiting=round(sum(found.get(WAITING, ()))),
        running=round(sum(found.get(RUNNING, ()))),
    )


CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class CacheFacts:
    """What ``vllm:cache_config_info`` says of the engine's KV cache (None: unsaid)."""

    prefix_caching: bool | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None  # the cache's size in blocks


def parse_cache_facts(text: str) -> CacheFacts:
    """The engine's prefix caching and block size from its ``/metrics`` text.

    Raises :class:`MetricsParseError` if the text cannot be parsed.
    """
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (CACHE_INFO, CACHE_INFO + "_total"):
                    return _cache_facts(sample.labels)
    except (ValueError, IndexError, TypeError) as exc:
        raise MetricsParseError(str(exc) or type(exc).__name__) from exc
    return CacheFacts()


PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"


def parse_prefix_cache_hits(text: str) -> float | None:
    """The prompt tokens the engine has found in its prefix cache since it started
    (``vllm:prefix_cache_hits_total``, summed over data-parallel ranks), or None
    if it does not export the counter.

    Read line by line rather than parsed whole: the proxy reads it around every
    piece of a pieced prompt, and vLLM's exposition is mostly histograms it does
    not need. A sample whose value is not a number raises
    :class:`MetricsParseError`.
    """
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(PREFIX_CACHE_HITS):
            continue
        name, sep, rest = line.partition("{")
        if sep:
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        if name.strip() not in (PREFIX_CACHE_HITS + "_total", PREFIX_CACHE_HITS):
            continue  # e.g. vllm:prefix_cache_hits_created
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError) as exc:
            raise MetricsParseError(f"{PREFIX_CACHE_HITS}: no value in {line!r}") from exc
        if math.isfinite(value):
            total, seen = total + value, True
    return total if seen else None


def _cache_facts(labels: dict[str, str]) -> CacheFacts:
    caching = labels.get("enable_prefix_caching")
    block = labels.get("block_size", "")
    blocks = labels.get("num_gpu_blocks", "")
    return CacheFacts(
        prefix_caching=None if caching is None else caching.strip().lower() == "true",
        block_size=int(block) if block.isdigit() and int(block) > 0 else None,
        num_gpu_blocks=int(blocks) if blocks.isdigit() and int(blocks) > 0 else None,
    )
