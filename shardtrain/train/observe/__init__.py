"""Observability: per-step metrics and the memory ledger, experiment trackers, profiler traces,
the timeline report, and straggler detection."""
