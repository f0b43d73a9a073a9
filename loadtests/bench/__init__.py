"""What things cost, printed as numbers (none of these is a test):

- :mod:`.overhead`: what the proxy costs against one free upstream
  (:mod:`.overhead_upstream`), beside nginx and vLLM's router
  (:mod:`.overhead_router`), under :mod:`.overhead_load`'s streams, and the scheduler
  alone (:mod:`.overhead_sched`) (``make bench``);
- :mod:`.aborts`: what aborting batch prefill for chats buys chat and costs batch;
- :mod:`.piecing`: what piecing costs batch on an idle engine;
- :mod:`.batch_store`: the batch store, SQLite against PostgreSQL;
- :mod:`.replicas`: several proxy replicas in front of the same engines.
"""
