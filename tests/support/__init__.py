"""What every test tier shares: ports and child processes (:mod:`.processes`), the
simulated engine and the proxy as logged child processes (:mod:`.children`), servers
on loopback sockets (:mod:`.served`), polling (:mod:`.polling`), SSE lines and raw
requests (:mod:`.http`), Prometheus samples (:mod:`.metrics`, over the bench's reader),
workload files' classes (:mod:`.workloads`).

The harness's own launchers cannot import ``tests/``, so the process and port helpers
live in :mod:`loadtests.support.processes` and :mod:`.processes` re-exports them.
"""

MODEL = "tiny"
"""The served model name every tier's engines answer to."""
