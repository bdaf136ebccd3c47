"""Checkpoint policy around the step: sharded saves (sync or async), durable commits, resume and
fallback past a bad checkpoint, full-disk handling, graceful interrupts."""
