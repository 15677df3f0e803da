"""What every zoo entry (and a user's own entry file) shares around its pipeline: one public module.

An entry's ``main()`` opens a :class:`Run`, builds its pipeline inline, each middleware with its role, and
trains::

    def main(cfg=None, **options):
        with Run(main, main_config, DQNPolicy, cfg, **options) as run:
            cfg, policy = run.cfg, run.policy
            task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
            task.use(StepCollector(cfg, policy.collect_mode, run.env("collector")), role=task.role.COLLECTOR)
            ...
            return run.train()

The same ``main()`` runs in one process, in async mode (``async_mode=True``: the collector-role middleware
run in a child process, ``env.async_collector``) and distributed (:func:`train_distributed`: every node runs
``main()`` and keeps the middleware of its role).

- :mod:`~conveyor.zoo.run.directory`: the run directory ``runs/<exp_name>/`` (``config.json``, ``log.txt``,
  ``ckpt/``, ``tb/``, ``nodes.json``), the saved config and the checks of a start or ``--resume``.
- :mod:`~conveyor.zoo.run.control`: seeding, the global generators as saved state, signals, the log file.
- :mod:`~conveyor.zoo.run.pipeline`: :class:`Run`.
- :mod:`~conveyor.zoo.run.nodes` and :mod:`~conveyor.zoo.run.clock`: distributed runs (:class:`Layout`,
  :func:`train_distributed`, :class:`LearnerClock`, :class:`RemoteEvaluations`); :mod:`~conveyor.zoo.run.learners`:
  several data-parallel learners in one run (``--learners L``).

Rules (docs/checkpoints.md): a new run refuses a name that already holds a run (continue it with
``resume=True``, or pick another name); ``resume=True`` reads the saved config and ``ckpt/latest.pth.tar``
and goes on exactly where that checkpoint was, in the layout it was trained in, or starts the run over from
its saved config when it stopped before its first checkpoint; SIGINT or SIGTERM finish the current
iteration, write ``final`` and ``latest`` and raise :class:`TrainingInterrupted` (a second signal stops at once).
"""
from conveyor.zoo.run.clock import (COLLECTOR_LEAD, EXCHANGE_TIMEOUT_S, PROGRESS_TOPIC, EvaluatedWeights, LearnerClock,
                                    RemoteEvaluations)
from conveyor.zoo.run.control import GlobalRNG, TrainingInterrupted, counters, seed_everything, stop_on_signals
from conveyor.zoo.run.directory import (CONFIG_FILE, LOG_FILE, NODES_FILE, RunDirError, check_exp_name, check_layout,
                                        config_differences, experiment_dir, prepare, read_run_config, run_directory)
from conveyor.zoo.run.nodes import DistributedRun, Layout, check_learners, is_offline, train_distributed
from conveyor.zoo.run.pipeline import DatasetMissing, Run

__all__ = ["COLLECTOR_LEAD", "CONFIG_FILE", "DatasetMissing", "DistributedRun", "EXCHANGE_TIMEOUT_S",
           "EvaluatedWeights", "GlobalRNG", "LOG_FILE", "Layout", "LearnerClock", "NODES_FILE", "PROGRESS_TOPIC",
           "RemoteEvaluations", "Run", "RunDirError", "TrainingInterrupted", "check_exp_name", "check_layout",
           "check_learners", "config_differences", "counters", "experiment_dir", "is_offline", "prepare",
           "read_run_config", "run_directory", "seed_everything", "stop_on_signals", "train_distributed"]
