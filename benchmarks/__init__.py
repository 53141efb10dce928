"""Benchmarks for chunklocal: one script per question of issue 6 (see BENCHMARKS.md).

Run them as modules from the repository root, e.g. ``python -m benchmarks.metadata --help``.
"""
