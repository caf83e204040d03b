"""Benchmarks behind `python -m benchmarks ...`: each writes JSON and a PNG."""
