"""A Prometheus exposition's samples, keyed by name and label set."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Samples of a Prometheus exposition, keyed by sample name and label set."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``; raises
    :class:`KeyError` if there is none."""
    wanted = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= ls]
    if not found:
        raise KeyError(f"no sample {name} with labels {labels}")
    return sum(found)
