"""Benchmarks and demos (`epd-bench`, `make demo`); measured side by side, never asserted in
tests."""
