"""Benchmark scripts, each run from the checkout's root as ``python -m benchmarks.NAME [--quick]``.

A script imports Conveyor and this package's private helper modules, never another script and never the tests:
``_harness`` (the ``--worker`` self-call, sides in turns, the final JSON line, peers, free ports), ``_training``
(an entry trained over a fixed budget, seed-by-seed comparisons), ``_fetch`` (offline minibatch fetching) and
``_cluster`` (a one-node Slurm cluster and marked job processes, which the launcher tests use too).
``_benchmarl`` is the evaluation callback of ``marl_learning``'s BenchMARL worker, importable only in BenchMARL's
own virtualenv. ``_impala_episodes_entry.py`` is an entry file that ``impala_learning`` trains by its path.
"""
