"""Stopping a pipeline on a budget."""
from __future__ import annotations

from typing import Optional

from conveyor.engine import OnlineRLContext, declares, task

__all__ = ["termination_checker"]


@declares(reads=("env_step", "train_iter"), factory=True)
def termination_checker(max_env_step: Optional[int] = None, max_train_iter: Optional[int] = None):
    """Sets ``task.finish`` once ``ctx.env_step >= max_env_step`` or ``ctx.train_iter >= max_train_iter``.

    Reads ctx: ``env_step``, ``train_iter``. Writes: ``task.finish``.
    """
    for name, value in (("max_env_step", max_env_step), ("max_train_iter", max_train_iter)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"termination_checker({name}={value!r}): must be an int >= 0 or None")

    @declares(reads=tuple(name for name, limit in (("env_step", max_env_step), ("train_iter", max_train_iter))
                          if limit is not None))  # only what it checks: an offline context has no env_step
    def _check(ctx: OnlineRLContext) -> None:
        if max_env_step is not None and ctx.env_step >= max_env_step:
            task.finish = True
        if max_train_iter is not None and ctx.train_iter >= max_train_iter:
            task.finish = True

    return _check
