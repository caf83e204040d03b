"""The benchmarks and experiments of a checkout (not in the wheel): ``python -m benchmarks NAME [options]``.

Each benchmark writes JSON and a PNG (docs/benchmarks.md shows the results); they use the library,
which never imports them (tests/test_layers.py).
"""
