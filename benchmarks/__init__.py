"""`make bench` (`python -m benchmarks.run`, from the repository root): the benchmarks of
docs/performance.md, a package beside `tests`, whose harness (`tests.support`) they import.
`upstream.py` and `floor.py` run as scripts of their own (`procs.py` starts them)."""
