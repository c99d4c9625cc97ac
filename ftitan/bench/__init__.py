"""Benchmarks behind ``ftitan bench ...``: JSON out, peers measured side by side."""
