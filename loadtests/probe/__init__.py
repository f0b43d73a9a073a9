"""``whoseturn probe``: does an engine interleave prefill with decode, seen from outside?

A steady decode stream runs on the engine while prompts of growing size are injected
beside it; the stream's worst stall around each prompt tells the two policies apart.
A serializing engine stalls decode for the whole prefill, so the stall grows with
the prompt; an interleaving one prefills a long prompt a chunk per step beside the
decodes, so the stall levels off once a prompt exceeds the chunk.

- :mod:`loadtests.probe.runner`: the I/O (:func:`run_probe`), over HTTP with httpx;
- :mod:`loadtests.probe.timeline`: stalls, steps and quiet gaps from token arrival times;
- :mod:`loadtests.probe.measurements`: what one injected prompt showed, grouped by size;
- :mod:`loadtests.probe.curve_fit`: a line and a broken line, least squares;
- :mod:`loadtests.probe.analysis`: the verdict (:func:`analyze`), pure;
- :mod:`loadtests.probe.verdict_text`: the plain sentence, the table, the JSON.
"""

from loadtests.engine_io import EngineInfo
from loadtests.probe.analysis import Analysis, ChunkFrom, Criteria, Verdict, analyze
from loadtests.probe.measurements import Injection, SizeStalls
from loadtests.probe.result import ProbeResult
from loadtests.probe.runner import ProbeConfig, ProbeError, default_sizes, run_probe

__all__ = [
    "Analysis",
    "ChunkFrom",
    "Criteria",
    "EngineInfo",
    "Injection",
    "ProbeConfig",
    "ProbeError",
    "ProbeResult",
    "SizeStalls",
    "Verdict",
    "analyze",
    "default_sizes",
    "run_probe",
]
