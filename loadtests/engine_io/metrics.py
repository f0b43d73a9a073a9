"""A Prometheus exposition's samples, read with ``prometheus_client``'s own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

LabelledSamples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> dict[str, float]:
    """A Prometheus exposition's samples, summed over label sets, by sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def labelled_samples(text: str) -> LabelledSamples:
    """A Prometheus exposition's samples, keyed by sample name and label set."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
