"""Studies and side-by-side benchmarks beside bench.py; measure.py holds what bench.py and the studies share."""
