"""Studies and side-by-side benchmarks beside bench.py: they build on bench.py, measure.py and the modules below
them, never the reverse."""
