"""The workload-evidence load-test harness (see shared/seed)."""
