"""``whoseturn demo``: chat beside a batch job on two simulated engines, directly and
through the proxy, as real processes on loopback; a side-by-side table and a result
directory (``result.json``, ``records.jsonl``, ``report.md``, PNG plots)."""
