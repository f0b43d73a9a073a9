"""The test bench: everything that measures or stands in for an engine, and nothing
that ``whoseturn serve`` runs. In folders by job, each importing only those above it
in this list:

- :mod:`loadtests.support`: what the others share: servers as child processes
  (ports, the proxy, PostgreSQL, real vLLM) and Markdown tables;
- :mod:`loadtests.engine_io`: measuring an engine over HTTP (engine facts,
  exact-length prompts, the SSE reader, token times, Prometheus samples);
- :mod:`loadtests.sim`: the simulated vLLM engine (``whoseturn sim``);
- :mod:`loadtests.probe`: does an engine interleave prefill with decode, seen from
  outside (``whoseturn probe``); :mod:`loadtests.probe.calibrate` fits a simulator
  profile to a real engine (``whoseturn sim calibrate``);
- :mod:`loadtests.harness`: the workload-evidence harness (see shared/seed):
  workloads, runs, reports, plots (``whoseturn loadtest``);
- :mod:`loadtests.compare`: the comparisons: direct against the proxy on real vLLM
  (``make compare``, ``make first-burst``), the simulator against real vLLM
  (fidelity), the harness against peers' clients (cross-checks);
- :mod:`loadtests.bench`: what things cost: the proxy's overhead (``make bench``),
  aborts, piecing, the batch store, replicas;
- :mod:`loadtests.demo`: ``whoseturn demo``;
- :mod:`loadtests.cli`: the bench's commands, which ``proxy.cli`` hands over to.

Data: ``corpus/`` (real prompt text, read by :mod:`loadtests.harness.corpus`) and
``workloads/*.yaml`` (workload files, :mod:`loadtests.harness.workload_file`).
"""
