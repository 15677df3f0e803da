"""Old home of the run machinery, now :mod:`conveyor.zoo.run`; re-exports what ``conveyor/cli/plot.py`` imports."""
from conveyor.zoo.run import RunDirError, TrainingInterrupted, read_run_config

__all__ = ["RunDirError", "TrainingInterrupted", "read_run_config"]
