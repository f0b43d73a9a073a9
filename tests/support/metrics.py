"""Reading a Prometheus exposition in tests: the samples come from the bench's reader
(:func:`loadtests.engine_io.labelled_samples`); this sums the ones a test asks for."""

from __future__ import annotations

from loadtests.engine_io.metrics import LabelledSamples


def metric_sum(samples: LabelledSamples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``; raises
    :class:`KeyError` if there is none."""
    wanted = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= ls]
    if not found:
        raise KeyError(f"no sample {name} with labels {labels}")
    return sum(found)
