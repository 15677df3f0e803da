"""A pipeline's saveable state: the context's kept fields, every stateful middleware, registered objects.

A stateful object has ``state_dict()`` / ``load_state_dict()``. Middleware are keyed ``"<position>:<name>"``
(``"2.1:trainer"``: the second member of the third middleware), stable across runs of the same script.
"""
from __future__ import annotations

from typing import Any, Dict, List

from conveyor.engine.compose import Middleware

__all__ = ["PipelineState", "stateful", "stateful_middleware"]


def stateful(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def stateful_middleware(chain: List[Middleware]) -> Dict[str, Any]:
    """``"<position>:<name>"`` -> the middleware object, for every stateful one of ``chain``, depth first."""
    found: Dict[str, Any] = {}

    def walk(records: List[Middleware], prefix: str) -> None:
        for k, mw in enumerate(records):
            fn = mw.fn
            while not stateful(fn) and getattr(fn, "__wrapped__", None) is not None:  # a task.use_wrapper wrapper
                fn = fn.__wrapped__
            if stateful(fn):
                found[f"{prefix}{k}:{mw.name}"] = fn
            walk(getattr(mw.fn, "_members", []), f"{prefix}{k}.")

    walk(chain, "")
    return found


class PipelineState:
    """The objects given to ``task.register_state``, and the gathering of a whole pipeline's state."""

    def __init__(self) -> None:
        self.objects: Dict[str, Any] = {}

    def register(self, name: str, obj: Any) -> None:
        """Include ``obj`` under ``name``; refuses a taken name or an object without state methods."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"task.register_state(name={name!r}): the name must be a non-empty string")
        if name in self.objects:
            raise ValueError(f"task.register_state('{name}'): already registered ({self.objects[name]!r}); "
                             f"use another name")
        if not stateful(obj):
            raise TypeError(f"task.register_state('{name}', {obj!r}): the object needs state_dict() and "
                            f"load_state_dict() methods")
        self.objects[name] = obj

    def gather(self, ctx: Any, chain: List[Middleware]) -> Dict[str, Any]:
        """``{"ctx": kept fields and total_step, "middleware": ..., "objects": ...}``."""
        return {"ctx": {**ctx.state_dict(), "total_step": ctx.total_step},
                "middleware": {key: fn.state_dict() for key, fn in stateful_middleware(chain).items()},
                "objects": {name: obj.state_dict() for name, obj in self.objects.items()}}

    def restore(self, state: Dict[str, Any], ctx: Any, chain: List[Middleware]) -> None:
        """Load what :meth:`gather` returned into ``ctx``, ``chain`` and the registered objects."""
        middleware = stateful_middleware(chain)
        saved_mw, saved_obj = state.get("middleware", {}), state.get("objects", {})
        for what, ours, saved in (("middleware", middleware, saved_mw), ("objects", self.objects, saved_obj)):
            if set(ours) != set(saved):
                raise ValueError(f"task.load_state_dict: {what} differ from the checkpoint's: missing "
                                 f"{sorted(set(ours) - set(saved))}, unexpected {sorted(set(saved) - set(ours))}; "
                                 f"was it saved by another pipeline?")
        kept = dict(state.get("ctx", {}))
        total_step = kept.pop("total_step", None)
        ctx.load_state_dict(kept)
        if total_step is not None:
            ctx.total_step = total_step
        for key, fn in middleware.items():
            fn.load_state_dict(saved_mw[key])
        for name, obj in self.objects.items():
            obj.load_state_dict(saved_obj[name])
