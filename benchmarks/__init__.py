"""Benchmarks, installed as ``radixkv.benchmarks`` and run through ``radixkv bench NAME``."""
