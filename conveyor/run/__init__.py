"""What every zoo entry (and a user's own entry file) shares around its pipeline: ``conveyor.run``.

An entry writes its pipeline as a function of the :class:`Run` (each middleware with its role) and hands it
to ``Run``, which trains it::

    def pipeline(run: Run) -> None:
        cfg, policy = run.cfg, run.policy
        task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
        task.use(StepCollector(cfg, policy.collect_mode, run.env("collector")), role=task.role.COLLECTOR)
        ...

    def main(cfg=None, **options):
        return Run(pipeline, main_config, DQNPolicy, cfg, **options).train()

The same ``pipeline`` runs in one process, in async mode (``async_mode=True``: an async run's collector
process calls it again with only the collector role, ``env.async_collector``) and distributed
(:func:`train_distributed`: every node runs ``main()`` and keeps the middleware of its role). Which of these a
run is, is decided in one place, :mod:`conveyor.run.modes`.

- :mod:`~conveyor.run.core`: :class:`Run`; :mod:`~conveyor.run.modes`: how a run opens in each layout.
- :mod:`~conveyor.run.directory`: the run directory ``runs/<exp_name>/`` (``config.json``, ``log.txt``,
  ``ckpt/``, ``tb/``, ``nodes.json``), the saved config and the checks of a start or ``--resume``.
- :mod:`~conveyor.run.control`: seeding, the global generators as saved state, signals, the log file.
- :mod:`~conveyor.run.nodes`: distributed runs (:class:`Layout`, :func:`train_distributed`); their middleware
  (``LearnerClock``, ``RemoteEvaluations``) are in :mod:`conveyor.middleware.distributed`;
  :mod:`~conveyor.run.learners`: several data-parallel learners in one run (``--learners L``).

Rules (docs/checkpoints.md): a new run refuses a name that already holds a run (continue it with
``resume=True``, or pick another name); ``resume=True`` reads the saved config and ``ckpt/latest.pth.tar``
and goes on exactly where that checkpoint was, in the layout it was trained in, or starts the run over from
its saved config when it stopped before its first checkpoint; SIGINT or SIGTERM finish the current
iteration, write ``final`` and ``latest`` and raise :class:`TrainingInterrupted` (a second signal stops at once).
"""
from conveyor.run.control import TrainingInterrupted
from conveyor.run.core import Run
from conveyor.run.directory import RunDirError
from conveyor.run.nodes import DistributedRun, Layout, train_distributed

__all__ = ["DistributedRun", "Layout", "Run", "RunDirError", "TrainingInterrupted", "train_distributed"]
