"""The comparisons, each a run that prints a table and writes a result directory:

- :mod:`.arms`: chat beside a batch job on real vLLM, three ways of running the engine
  alone against the proxy in front of it (``make compare``), over the workload of
  :mod:`.baseline`;
- :mod:`.first_burst`: the first batch burst beside live chat on real vLLM, direct
  FCFS against the proxy (``make first-burst``);
- :mod:`.fidelity`: the simulator against real vLLM, replaying :mod:`.arms`' records;
- :mod:`.crosscheck_guidellm`, :mod:`.crosscheck_vllm`: the harness against peers'
  clients (GuideLLM; ``vllm bench serve``, ``make crosscheck-vllm``).
"""
