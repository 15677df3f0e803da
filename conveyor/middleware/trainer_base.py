"""The base of the trainers (the on-policy :class:`~conveyor.middleware.MultistepTrainer` and
:class:`~conveyor.middleware.Trainer`, IMPALA's :class:`~conveyor.middleware.UnrollLearner`): the learn view check,
the learning-rate schedule, one learn step and the state a resume needs.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import numpy as np

from conveyor.engine import OnlineRLContext, declares
from conveyor.middleware.protocols import LearnPolicy, check_learn_view
from conveyor.policy.learning import LearnResult

__all__ = ["LrSchedule", "TrainerBase", "learn_int"]


def learn_int(value: Any, key: str, where: str, minimum: int = 1) -> int:
    """``cfg.policy.learn.<key>`` checked: an int of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{where}: cfg.policy.learn.{key} must be an int {bound}, got {value!r}")
    return value


class LrSchedule:
    """Linear learning-rate annealing to 0 over ``learn.lr_anneal_steps`` env steps or training rounds
    (``learn.lr_anneal_unit``), set on the policy before each round; rounds are counted here."""

    def __init__(self, learn: Any, where: str) -> None:
        steps = learn.get("lr_anneal_steps")
        self.steps = None if steps is None else learn_int(steps, "lr_anneal_steps", where)
        self.unit = learn.get("lr_anneal_unit", "env_step")
        if self.unit not in ("env_step", "iteration"):
            raise ValueError(f"{where}: cfg.policy.learn.lr_anneal_unit must be 'env_step' or 'iteration', "
                             f"got {self.unit!r}")
        self.rounds = 0

    def apply(self, ctx: OnlineRLContext, policy: Any) -> None:
        """Set the policy's learning-rate factor for the round about to start, and count the round."""
        if self.steps is not None:
            done = ctx.env_step if self.unit == "env_step" else self.rounds
            policy.set_lr_factor(max(0.0, 1.0 - done / self.steps))
        self.rounds += 1


@declares(reads=("train_data", "train_iter", "env_step"), writes=("train_iter", "train_output"))
class TrainerBase:
    """What the trainers share: the learn view check, the lr schedule, the checkpointed state. A subclass calls
    ``_begin(ctx)`` before a round and ``_step(ctx, batch, outputs)`` for each gradient step.

    ``env_step`` is read only to anneal the learning rate by env steps; an instance that does not declares
    without it, so it fits contexts that have none (``OfflineRLContext``).
    """

    def __init__(self, cfg: Any, policy: LearnPolicy, where: str) -> None:
        check_learn_view(policy, where)
        self._policy, self._where = policy, where
        self._schedule = LrSchedule(cfg.policy.learn, where)
        if self._schedule.steps is not None and not callable(getattr(policy, "set_lr_factor", None)):
            raise TypeError(f"{where}: cfg.policy.learn.lr_anneal_steps needs a learn view with set_lr_factor(), "
                            f"such as policy.learn_mode; got {policy!r}")
        if self._schedule.steps is None or self._schedule.unit != "env_step":
            declares(reads=("train_data", "train_iter"), writes=("train_iter", "train_output"))(self)
        self._rng = np.random.default_rng(cfg.get("seed"))

    def state_dict(self) -> Dict[str, Any]:
        """The shuffling generator's state and the rounds trained (for annealing by rounds)."""
        return {"rng": copy.deepcopy(self._rng.bit_generator.state), "rounds": self._schedule.rounds}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._rng.bit_generator.state = copy.deepcopy(state["rng"])
        self._schedule.rounds = int(state["rounds"])

    def _begin(self, ctx: OnlineRLContext) -> None:
        """Before a round's steps: the learning rate for it, and the round's batch handed to the view's ``gather``
        where it has one (statistics the policy keeps of the data it learns from: PPO's reward normaliser)."""
        self._schedule.apply(ctx, self._policy)
        gather = getattr(self._policy, "gather", None)
        if gather is not None:
            gather(ctx.train_data)

    def _step(self, ctx: OnlineRLContext, batch: Any, outputs: List[Dict[str, Any]]) -> bool:
        """One learn step; whether the round goes on (the policy may decline a step and end it: ``early_stop``)."""
        result = LearnResult.of(self._policy.forward(batch), self._where)
        outputs.append(result.metrics)
        if not result.early_stop:
            ctx.train_iter += 1
        return not result.early_stop
