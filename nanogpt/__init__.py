"""The library behind the commands at the repository's root (train.py, sample.py, bench.py, ...): one flat package,
a module per job. Importing the package imports none of them; each is imported by name (from nanogpt import dataio)."""
