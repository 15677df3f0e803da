"""Benchmark scripts, each run from the checkout's root as ``python -m benchmarks.NAME [--quick]``.

A script imports Conveyor and this package's private helper modules (``_harness``: workers, sides, peers, the
JSON line; ``_training``, ``_fetch``, ``_cluster``), never another script and never the tests.
"""
