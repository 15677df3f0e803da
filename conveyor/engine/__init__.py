"""The pipeline runtime: a task runs middleware over dataclass contexts. It knows nothing of RL.

Importing it loads no torch, gymnasium or pynng, so it stays a fast, general runtime.
"""
from conveyor.engine.compose import Middleware, MiddlewareError, compose
from conveyor.engine.context import Context, OfflineRLContext, OnlineRLContext
from conveyor.engine.events import EventBus
from conveyor.engine.task import CLOSE_EVENT, FINISH_EVENT, Task, task

__all__ = ["CLOSE_EVENT", "Context", "EventBus", "FINISH_EVENT", "Middleware", "MiddlewareError", "OfflineRLContext", "OnlineRLContext", "Task",
           "compose", "task"]
