"""On-policy training on the batch an advantage estimator left in ``ctx.train_data``.

Both trainers call ``learn_mode.forward(batch)``, one gradient step per call, as every learner does, and
put each step's metrics (its :class:`~conveyor.policy.LearnResult`'s ``metrics``) in ``ctx.train_output``;
they differ in what they hand it:

- :func:`multistep_trainer` (:class:`MultistepTrainer`) runs ``cfg.policy.learn.epoch_per_collect`` shuffled
  passes over the batch in minibatches of ``batch_size`` transitions: PPO's update.
- :func:`trainer` (:class:`Trainer`) hands the whole batch over ``cfg.policy.learn.update_per_collect`` times
  (default 1): full-batch steps, as A2C takes them, or for a policy that minibatches inside its own step.

Both are small classes whose ``state_dict()`` holds what a resume needs (the shuffling generator, the
rounds trained for the learning-rate schedule); both hand each round's batch to the view's ``gather`` first
(statistics a policy keeps of what it learns from, such as PPO's reward normaliser) and publish the weights
once per round.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, List, Protocol

import numpy as np
import torch
import treevalue

from conveyor.data.batch import sample_dim
from conveyor.engine import OnlineRLContext, declares
from conveyor.policy.learning import LearnResult

__all__ = ["multistep_trainer", "trainer", "MultistepTrainer", "Trainer"]


class LearnPolicy(Protocol):
    def forward(self, batch: Any) -> LearnResult: ...

    def publish(self) -> int: ...


def _check_learn_view(policy: Any, where: str) -> None:
    if not callable(getattr(policy, "forward", None)) or not callable(getattr(policy, "publish", None)):
        raise TypeError(f"{where} needs a learn view with forward(batch) and publish(), such as "
                        f"policy.learn_mode; got {policy!r}")


def _learn_int(value: Any, key: str, where: str, minimum: int = 1) -> int:
    """``cfg.policy.learn.<key>`` checked: an int of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{where}: cfg.policy.learn.{key} must be an int {bound}, got {value!r}")
    return value


class _LrSchedule:
    """Linear learning-rate annealing to 0 over ``learn.lr_anneal_steps`` env steps or training rounds
    (``learn.lr_anneal_unit``), set on the policy before each round; rounds are counted here."""

    def __init__(self, learn: Any, where: str) -> None:
        steps = learn.get("lr_anneal_steps")
        self.steps = None if steps is None else _learn_int(steps, "lr_anneal_steps", where)
        self.unit = learn.get("lr_anneal_unit", "env_step")
        if self.unit not in ("env_step", "iteration"):
            raise ValueError(f"{where}: cfg.policy.learn.lr_anneal_unit must be 'env_step' or 'iteration', "
                             f"got {self.unit!r}")
        self.rounds = 0

    def apply(self, ctx: OnlineRLContext, policy: Any) -> None:
        if self.steps is not None:
            done = ctx.env_step if self.unit == "env_step" else self.rounds
            policy.set_lr_factor(max(0.0, 1.0 - done / self.steps))
        self.rounds += 1


@declares(reads=("train_data", "train_iter", "env_step"), writes=("train_iter", "train_output"))
class _Trainer:
    """What both trainers share: the learn view check, the lr schedule, the checkpointed state.

    ``env_step`` is read only to anneal the learning rate by env steps; an instance that does not declares
    without it, so it fits contexts that have none (``OfflineRLContext``).
    """

    def __init__(self, cfg: Any, policy: LearnPolicy, where: str) -> None:
        _check_learn_view(policy, where)
        self._policy, self._where = policy, where
        self._schedule = _LrSchedule(cfg.policy.learn, where)
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


class MultistepTrainer(_Trainer):
    """``epoch_per_collect`` passes over ``ctx.train_data`` in shuffled minibatches, one gradient step each.

    Minibatches are cut along the batch's last leading dim (that of ``reward``): rows of a flat batch
    ``[B]``, whole sequences of a recurrent policy's ``[L, B]`` batch, ``batch_size // L`` at a time. The
    last minibatch of a pass holds the remainder when ``batch_size`` does not divide the batch.
    Shuffling draws from a generator seeded with ``cfg.seed``. A step whose result has ``early_stop`` (PPO
    with ``learn.target_kl``: the policy moved too far from the collecting one, checked before stepping)
    took no gradient step and ends the round. With ``learn.lr_anneal_steps`` the learning rate is set
    before each round (see ``lr_anneal_unit``). After the round the weights are published once.
    ``state_dict()`` holds the shuffling generator and the rounds trained.

    Reads ctx: ``train_data``, ``train_iter``, ``env_step``.
    Writes ctx: ``train_iter`` (+1 per gradient step), ``train_output`` (list of per-step metric dicts).
    """

    def __init__(self, cfg: Any, policy: LearnPolicy) -> None:
        super().__init__(cfg, policy, "multistep_trainer")
        learn = cfg.policy.learn
        self._epochs = _learn_int(learn.get("epoch_per_collect"), "epoch_per_collect", "multistep_trainer")
        self._batch_size = _learn_int(learn.get("batch_size"), "batch_size", "multistep_trainer")

    def __repr__(self) -> str:
        return f"MultistepTrainer(epoch_per_collect={self._epochs}, batch_size={self._batch_size})"

    def __call__(self, ctx: OnlineRLContext) -> None:
        data = ctx.train_data
        if data is None:
            return
        self._begin(ctx)
        dim = sample_dim(data)  # 1: sequences [L, B], minibatches of whole sequences
        size = data.reward.shape[dim]
        per_step = max(1, self._batch_size // data.reward.shape[0]) if dim else self._batch_size
        outputs: List[Dict[str, Any]] = []
        for _ in range(self._epochs):
            if per_step >= size:  # one minibatch holds everything: no gathering, its order does not matter
                minibatches: Iterable[Any] = (data,)
            else:
                order = torch.from_numpy(self._rng.permutation(size))
                minibatches = (_rows(data, dim, index) for index in order.split(per_step))
            if not all(self._step(ctx, minibatch, outputs) for minibatch in minibatches):
                break
        self._policy.publish()
        ctx.train_output = outputs


class Trainer(_Trainer):
    """``cfg.policy.learn.update_per_collect`` (default 1) gradient steps, each on all of ``ctx.train_data``;
    an ``early_stop`` step ends the round, the learning rate follows ``lr_anneal_steps`` and the weights are
    published after the round, as in :class:`MultistepTrainer`.

    Reads ctx: ``train_data``, ``train_iter``, ``env_step``.
    Writes ctx: ``train_iter`` (+1 per gradient step), ``train_output`` (list of per-step metric dicts).
    """

    def __init__(self, cfg: Any, policy: LearnPolicy) -> None:
        super().__init__(cfg, policy, "trainer")
        self._updates = _learn_int(cfg.policy.learn.get("update_per_collect", 1), "update_per_collect", "trainer")

    def __repr__(self) -> str:
        return f"Trainer(update_per_collect={self._updates})"

    def __call__(self, ctx: OnlineRLContext) -> None:
        if ctx.train_data is None:
            return
        self._begin(ctx)
        outputs: List[Dict[str, Any]] = []
        for _ in range(self._updates):
            if not self._step(ctx, ctx.train_data, outputs):
                break
        self._policy.publish()
        ctx.train_output = outputs


def _rows(data: Any, dim: int, index: torch.Tensor) -> Any:
    """``data``'s rows ``index`` along ``dim`` (leaf by leaf, by ``index_select``: on a uint8 image batch about 10x
    faster than ``data[index]``'s advanced indexing, with the same values)."""
    if isinstance(data, torch.Tensor):
        return data.index_select(dim, index)
    return treevalue.mapping(data, lambda leaf: leaf.index_select(dim, index))


def multistep_trainer(cfg: Any, policy: LearnPolicy) -> MultistepTrainer:
    """PPO's update: epochs of shuffled minibatches (see :class:`MultistepTrainer`)."""
    return MultistepTrainer(cfg, policy)


def trainer(cfg: Any, policy: LearnPolicy) -> Trainer:
    """Full-batch steps (see :class:`Trainer`)."""
    return Trainer(cfg, policy)
