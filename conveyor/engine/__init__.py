"""The pipeline runtime: a task runs middleware over dataclass contexts. It knows nothing of RL.

Importing it loads no torch, gymnasium or pynng, so it stays a fast, general runtime; ``Parallel`` (the
multi-process runner, :mod:`conveyor.engine.parallel.runner`) is imported on first use.
"""
from conveyor.engine.compose import Middleware, MiddlewareError, compose
from conveyor.engine.declare import Fields, PipelineError, PipelineTable, declares, fields_of
from conveyor.engine.context import Context, OfflineRLContext, OnlineRLContext
from conveyor.engine.events import EventBus
from conveyor.engine.task import CLOSE_EVENT, FINISH_EVENT, PEER_LOST_EVENT, STOP_EVENT, Inspection, Role, Task, task

__all__ = ["CLOSE_EVENT", "Context", "EventBus", "FINISH_EVENT", "Fields", "Inspection", "Middleware", "MiddlewareError",
           "OfflineRLContext", "OnlineRLContext", "PEER_LOST_EVENT", "PipelineError", "PipelineTable", "Role",
           "STOP_EVENT", "Task", "compose", "declares", "fields_of", "task"]  # and Parallel, imported on first use


def __getattr__(name: str):
    if name == "Parallel":  # the multi-process runner: loaded only when asked for
        from conveyor.engine.parallel.runner import Parallel
        return Parallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
