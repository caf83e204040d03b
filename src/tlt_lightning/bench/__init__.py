"""Benchmarks behind `tlt-lightning bench ...`: each writes JSON and a PNG."""
