"""What the benchmarks share: the geometry and its caches (geometry.py), the two-process
runner (runner.py) and the report writer (report.py)."""
