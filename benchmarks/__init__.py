"""Benchmark harness for megatrain_ds: model shapes, baseline systems and a one-system-per-process
CLI."""
