"""What the middleware need of the policy views and buffers they are handed, written once for all of them.

Middleware never import a policy or buffer class: they call these methods (duck typing; the protocols are for
readers and type checkers). :func:`check_learn_view` is the check every learner makes when it is built.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol

import numpy as np

from conveyor.policy.learning import LearnResult

__all__ = ["Buffer", "CollectPolicy", "LearnPolicy", "ValuePolicy", "check_learn_view"]


class CollectPolicy(Protocol):
    """A collect view (``policy.collect_mode``): actions for a batch of observations, per-env state reset."""

    def forward(self, obs: Any, **kwargs: Any) -> Dict[str, Any]: ...

    def reset(self, env_ids: Optional[List[int]] = None) -> None: ...


class ValuePolicy(Protocol):
    """A view with ``value``; ``scale_reward(reward, done) -> (reward, discounted_return or None)`` is read too
    where it has one (as ``ActorCriticCollectMode``)."""

    def value(self, obs: Any, **state: Any) -> np.ndarray: ...


class LearnPolicy(Protocol):
    """A learn view (``policy.learn_mode``): one gradient step per ``forward(batch)``, weights published by
    ``publish()``."""

    def forward(self, batch: Any) -> LearnResult: ...

    def publish(self) -> int: ...


class Buffer(Protocol):
    """A replay buffer (:class:`~conveyor.data.DequeBuffer`): pushers and estimators only ``extend`` it, learners
    sample it and write priorities back."""

    def extend(self, batch: Any) -> None: ...

    def sample(self, n: int) -> Any: ...

    def update_priority(self, index: Any, priority: Any) -> None: ...

    @property
    def prioritized(self) -> bool: ...

    def __len__(self) -> int: ...


def check_learn_view(policy: Any, where: str) -> None:
    """Raise a ``TypeError`` naming ``where`` and the fix unless ``policy`` has the :class:`LearnPolicy` methods."""
    if not callable(getattr(policy, "forward", None)) or not callable(getattr(policy, "publish", None)):
        raise TypeError(f"{where} needs a learn view with forward(batch) and publish(), such as "
                        f"policy.learn_mode; got {policy!r}")
