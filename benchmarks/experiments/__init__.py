"""One-off measurements behind docs/performance.md (`python -m benchmarks.experiments.NAME`)."""
