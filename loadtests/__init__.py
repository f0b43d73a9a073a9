"""The test bench: everything that measures or stands in for an engine, and nothing
that ``whoseturn serve`` runs.

- :mod:`loadtests.sim`: the simulated vLLM engine (``whoseturn sim``);
- :mod:`loadtests.probe`: does an engine interleave prefill with decode, seen from
  outside (``whoseturn probe``); :mod:`loadtests.probe.calibrate` fits a simulator
  profile to a real engine (``whoseturn sim calibrate``);
- :mod:`loadtests.engine_io`: measuring an engine over HTTP (engine facts,
  exact-length prompts, the SSE reader, token times, Prometheus samples);
- :mod:`loadtests.processes`: servers as child processes on loopback ports;
- the workload-evidence harness (see shared/seed): :mod:`.client` (the load client),
  :mod:`.corpus` (real prompt text, with the files of ``loadtests/corpus/``),
  :mod:`.workload_file`, :mod:`.harness`, :mod:`.runs`, :mod:`.engines` (engines the
  harness starts), :mod:`.watch` (``/metrics`` scrapes and the OS view during a run),
  :mod:`.crosscheck` (against GuideLLM), :mod:`.baseline`, :mod:`.compare`,
  :mod:`.fidelity`, :mod:`.stalls`, :mod:`.vllm` (real vLLM as a child process).
"""
