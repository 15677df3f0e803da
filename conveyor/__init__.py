"""Conveyor: reinforcement learning as a pipeline of small middleware over a context."""
from conveyor.engine import Context, OfflineRLContext, OnlineRLContext, Task, task

__version__ = "0.1.0"

__all__ = ["Context", "OfflineRLContext", "OnlineRLContext", "Task", "__version__", "task"]
