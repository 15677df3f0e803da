"""On-policy training on the batch an advantage estimator left in ``ctx.train_data``.

Both trainers call ``learn_mode.forward(batch)``, one gradient step per call, as every learner does;
they differ in what they hand it:

- :func:`multistep_trainer` runs ``cfg.policy.learn.epoch_per_collect`` shuffled passes over the batch
  in minibatches of ``batch_size`` transitions: PPO's update.
- :func:`trainer` hands the whole batch over ``cfg.policy.learn.update_per_collect`` times (default 1):
  full-batch steps, as A2C takes them, or for a policy that minibatches inside its own step.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Protocol

import numpy as np
import torch

from conveyor.engine import OnlineRLContext

__all__ = ["multistep_trainer", "trainer"]


class LearnPolicy(Protocol):
    def forward(self, batch: Any) -> Dict[str, Any]: ...

    def publish(self) -> int: ...


def _check_learn_view(policy: Any, where: str) -> None:
    if not callable(getattr(policy, "forward", None)) or not callable(getattr(policy, "publish", None)):
        raise TypeError(f"{where} needs a learn view with forward(batch) and publish(), such as "
                        f"policy.learn_mode; got {policy!r}")


def _positive_int(value: Any, key: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}: cfg.policy.learn.{key} must be an int > 0, got {value!r}")
    return value


def multistep_trainer(cfg: Any, policy: LearnPolicy):
    """``epoch_per_collect`` passes over ``ctx.train_data`` in shuffled minibatches, one gradient step each.

    Minibatches are cut along the batch's last leading dim (that of ``reward``): rows of a flat batch
    ``[B]``, whole sequences of a recurrent policy's ``[L, B]`` batch, ``batch_size // L`` at a time. The
    last minibatch of a pass holds the remainder when ``batch_size`` does not divide the batch.
    Shuffling draws from a generator seeded with ``cfg.seed``. With ``cfg.policy.learn.target_kl`` set,
    the round stops early once a step reports ``charts/approx_kl`` above ``1.5 * target_kl`` (the
    policy has moved far enough from the one that collected the data; Stable-Baselines3's rule).

    Reads ctx: ``train_data``, ``train_iter``.
    Writes ctx: ``train_iter`` (+1 per gradient step), ``train_output`` (list of per-step metric dicts).
    """
    _check_learn_view(policy, "multistep_trainer")
    learn = cfg.policy.learn
    epochs = _positive_int(learn.get("epoch_per_collect"), "epoch_per_collect", "multistep_trainer")
    batch_size = _positive_int(learn.get("batch_size"), "batch_size", "multistep_trainer")
    target_kl = learn.get("target_kl")
    max_kl = None if target_kl is None else 1.5 * float(target_kl)
    rng = np.random.default_rng(cfg.get("seed"))

    def _train(ctx: OnlineRLContext) -> None:
        data = ctx.train_data
        if data is None:
            return
        sequences = data.reward.ndim == 2  # [L, B]: minibatches of whole sequences
        size = data.reward.shape[-1]
        per_step = max(1, batch_size // data.reward.shape[0]) if sequences else batch_size
        outputs: List[Dict[str, Any]] = []
        for _ in range(epochs):
            if per_step >= size:  # one minibatch holds everything: no gathering, its order does not matter
                minibatches: Iterable[Any] = (data,)
            else:
                order = torch.from_numpy(rng.permutation(size))
                minibatches = (data[:, index] if sequences else data[index]
                               for index in order.split(per_step))
            for minibatch in minibatches:
                out = policy.forward(minibatch)
                outputs.append(out)
                ctx.train_iter += 1
                if max_kl is not None and out.get("charts/approx_kl", 0.0) > max_kl:
                    break
            else:
                continue
            break
        policy.publish()
        ctx.train_output = outputs

    return _train


def trainer(cfg: Any, policy: LearnPolicy):
    """``cfg.policy.learn.update_per_collect`` (default 1) gradient steps, each on all of ``ctx.train_data``.

    Reads ctx: ``train_data``, ``train_iter``.
    Writes ctx: ``train_iter`` (+1 per gradient step), ``train_output`` (list of per-step metric dicts).
    """
    _check_learn_view(policy, "trainer")
    updates = _positive_int(cfg.policy.learn.get("update_per_collect", 1), "update_per_collect", "trainer")

    def _train(ctx: OnlineRLContext) -> None:
        if ctx.train_data is None:
            return
        outputs: List[Dict[str, Any]] = []
        for _ in range(updates):
            outputs.append(policy.forward(ctx.train_data))
            ctx.train_iter += 1
        policy.publish()
        ctx.train_output = outputs

    return _train
