"""The workload-evidence harness: a workload file driven over HTTP against one or two
arms, every request recorded, and the result directory it leaves (``whoseturn
loadtest``; ``whoseturn demo`` runs it too).

- the workload: :mod:`.workload_file` (``loadtests/workloads/*.yaml``, checked on
  load), :mod:`.arrivals` (when open-loop requests are sent), :mod:`.corpus` (real
  prompt text, from ``loadtests/corpus/``);
- sending it: :mod:`.client` (the streaming client that times what a user sees),
  :mod:`.traffic` (one arm's run), :mod:`.runs` (a plan's runs against its arms),
  :mod:`.engines` (engines and proxy the harness starts itself), :mod:`.loadtest`
  (the command);
- watching: :mod:`.watch` (the servers' ``/metrics`` and the OS view),
  :mod:`.stalls` (the machine's own stops);
- the figures: :mod:`.validity` (whether an answer counts), :mod:`.measures`,
  :mod:`.buckets` (TTFT by prompt length), :mod:`.engine_histograms` (the engine's
  own view), :mod:`.tenants` (a row per tenant);
- the report: :mod:`.report`, :mod:`.report_sections`, :mod:`.plots`.
"""
