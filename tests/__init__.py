"""The test suite. A package so that `tests.support` is importable by the test modules, the
demo (`python -m tests.demo`) and the benchmarks."""
