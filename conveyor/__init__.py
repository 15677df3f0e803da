"""Conveyor: reinforcement learning as a pipeline of small middleware over a context."""
import warnings

# treevalue (under DI-treetensor) registers its trees with a torch pytree API that torch deprecates, so
# every run printed that FutureWarning; it is not ours to fix, so it is filtered by its exact text.
warnings.filterwarnings("ignore", message=r"`torch\.utils\._pytree\._register_pytree_node` is deprecated",
                        category=FutureWarning)

from conveyor.engine import Context, OfflineRLContext, OnlineRLContext, Task, task

__version__ = "0.1.0"

__all__ = ["Context", "OfflineRLContext", "OnlineRLContext", "Task", "__version__", "task"]
