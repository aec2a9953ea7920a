"""Benchmarks: selector strategies and the serving comparison."""
