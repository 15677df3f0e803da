"""The views a pipeline sees a policy through: learn (:class:`LearnMode`), collect (:class:`CollectMode`,
:class:`ActorCriticCollectMode`) and eval (:class:`EvalMode`), and :class:`Snapshot`, a collect or eval view
pinned to one published version of the weights (see :mod:`conveyor.policy.weights`)."""
from __future__ import annotations

import copy
import weakref
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
import torch

from conveyor.policy.learning import LearnResult
from conveyor.policy.weights import Acting, Version



class Viewed(Protocol):
    """What a view needs of its policy: :class:`conveyor.policy.base.Policy` (not imported: it imports this module)."""

    rng: Any
    train_iter: int
    version: int
    _weights: Any
    _learn_lock: Any
    finite_steps: Any

    def publish(self) -> int: ...
    def set_lr_factor(self, factor: float) -> None: ...
    def join_data_parallel(self, group: Any) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
    def _forward_learn(self, batch: Any) -> Any: ...
    def _forward_collect(self, acting: Acting, obs: Any, **kwargs: Any) -> dict: ...
    def _forward_eval(self, acting: Acting, obs: Any) -> dict: ...
    def _value(self, acting: Acting, obs: Any, **kwargs: Any) -> Any: ...
    def _scale_reward(self, acting: Acting, reward: Any, done: Any) -> Any: ...
    def _gather(self, batch: Any) -> None: ...
    def _obs_to_tensor(self, obs: Any) -> Any: ...
    def _batch_to_tensor(self, batch: Any) -> Any: ...
    def _reset(self, memory: dict, env_ids: Sequence[int] | None) -> None: ...
    def _checkpoint(self, version: Any) -> dict: ...

__all__ = ["LearnMode", "ActorCriticLearnMode", "CollectMode", "ActorCriticCollectMode", "EvalMode", "Snapshot"]


class LearnMode:
    """The learner's view of a policy."""

    __slots__ = ("_policy",)

    def __init__(self, policy: Viewed) -> None:
        self._policy = policy

    def forward(self, batch: Any) -> LearnResult:
        """One update on ``batch`` (a ttorch tree of transitions, or a dict of numpy arrays): its metrics, and
        the new priorities or an early stop when the policy has them (see :class:`LearnResult`)."""
        policy = self._policy
        batch = policy._batch_to_tensor(batch)
        policy._weights.newest()  # version 0 holds the initial weights, never updated ones
        with policy._learn_lock:
            result = LearnResult.of(policy._forward_learn(batch), f"{type(policy).__name__}._forward_learn")
        if policy.finite_steps.skipped:  # logged with the step's metrics once any step was skipped
            result.metrics["charts/skipped_updates"] = float(policy.finite_steps.skipped)
        return result

    def publish(self) -> int:
        """Make the current weights the newest acting version (see :meth:`Policy.publish`); its number."""
        return self._policy.publish()

    def set_lr_factor(self, factor: float) -> None:
        """Scale the configured learning rates by ``factor`` (see :meth:`Policy.set_lr_factor`)."""
        self._policy.set_lr_factor(factor)

    def join_data_parallel(self, group: Any) -> None:
        """Learn as one of a :class:`~conveyor.policy.data_parallel.DataParallel` group's learners (see
        :meth:`Policy.join_data_parallel`)."""
        self._policy.join_data_parallel(group)

    @property
    def train_iter(self) -> int:
        """Gradient steps taken so far."""
        return self._policy.train_iter

    def state_dict(self) -> dict[str, Any]:
        """The policy's checkpoint (see :meth:`Policy.state_dict`)."""
        return self._policy.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the policy from a checkpoint (see :meth:`Policy.load_state_dict`)."""
        self._policy.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"<learn_mode of {type(self._policy).__name__}>"


class ActorCriticLearnMode(LearnMode):
    """The learner's view of a policy that keeps statistics of the batches it learns from (PPO's reward
    normaliser): also ``gather(batch)``. Such a policy installs it in its constructor:
    ``self._learn_mode = ActorCriticLearnMode(self)``."""

    __slots__ = ()

    def gather(self, batch: Any) -> None:
        """Take what the policy keeps statistics of from a round's batch (PPO's ``discounted_return``), to fold
        in at the next publish; trainers call it once per round, before its steps."""
        policy = self._policy
        policy._gather(policy._batch_to_tensor(batch))


def _collect(policy: Viewed, version: Version, memory: dict, obs: Any, kwargs: dict) -> dict[str, Any]:
    with torch.no_grad():
        out = policy._forward_collect(Acting(version, memory), policy._obs_to_tensor(obs), **kwargs)
    out["weight_version"] = np.full(len(out["action"]), version.number, dtype=np.int64)
    return out


def _evaluate(policy: Viewed, version: Version, memory: dict, obs: Any) -> dict[str, Any]:
    with torch.no_grad():
        return policy._forward_eval(Acting(version, memory), policy._obs_to_tensor(obs))


class _ActingView:
    """What the collect and eval views share: the policy, the view's per-env memory, reset and version."""

    __slots__ = ("_policy", "_memory")
    _name = "acting view"

    def __init__(self, policy: Viewed) -> None:
        self._policy = policy
        self._memory: dict = {}

    def reset(self, env_ids: Sequence[int] | None = None) -> None:
        """Forget per-env state of ``env_ids`` (all envs for ``None``), e.g. when their episodes restart."""
        self._policy._reset(self._memory, env_ids)

    @property
    def version(self) -> int:
        """The newest published version, which the next ``forward`` acts on."""
        return self._policy.version

    def __repr__(self) -> str:
        return f"<{self._name} of {type(self._policy).__name__}>"


class CollectMode(_ActingView):
    """The collector's view of a policy: acts on the newest published version of the weights."""

    __slots__ = ()
    _name = "collect_mode"

    def forward(self, obs: Any, **kwargs: Any) -> dict[str, Any]:
        """Actions (numpy ``[N, ...]``) for an env manager's batch of observations, exploring per ``kwargs``,
        and ``weight_version`` (int64 ``[N]``): the published version that chose them."""
        weights = self._policy._weights
        version = weights.pin()
        try:
            return _collect(self._policy, version, self._memory, obs, kwargs)
        finally:
            weights.unpin(version)

    def snapshot(self) -> Snapshot:
        """A collect view pinned to the newest version (see :class:`Snapshot`)."""
        return Snapshot(self._policy, "collect")

    def state_dict(self) -> dict[str, Any]:
        """What collecting carries from one call to the next: the per-env state (``memory``: a recurrent policy's
        hidden state) and the exploration generator (``rng``). A replica that acts elsewhere (a collector
        process) is checkpointed with it; the learner's own policy saves its ``rng`` in :meth:`Policy.state_dict`.
        ``policy``: what else the policy carries between calls (PPO's running discounted returns for ``reward_norm``)."""
        return {"memory": copy.deepcopy(self._memory), "rng": copy.deepcopy(self._policy.rng.bit_generator.state),
                "policy": copy.deepcopy(self._policy._collect_state())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on collecting from :meth:`state_dict`."""
        self._memory.clear()
        self._memory.update(copy.deepcopy(dict(state["memory"])))
        self._policy.rng.bit_generator.state = dict(state["rng"])
        self._policy._load_collect_state(state.get("policy", {}))  # absent from checkpoints saved before it was kept


class ActorCriticCollectMode(CollectMode):
    """The collector's view of a policy with a critic: also ``value(obs, **state)`` (via :meth:`Policy._value`),
    which advantage estimators bootstrap with. Such a policy installs it in its constructor:
    ``self._collect_mode = ActorCriticCollectMode(self)``."""

    __slots__ = ()

    def value(self, obs: Any, **state: Any) -> np.ndarray:
        """State values (numpy float32 ``[B]``) of a batch of observations, numpy or tensors, by the newest
        published version. A recurrent policy also takes its state before ``obs`` (e.g. ``hidden=``, as stored
        in the trajectory)."""
        policy, weights = self._policy, self._policy._weights
        version = weights.pin()
        try:
            with torch.no_grad():
                return policy._value(Acting(version, self._memory), policy._obs_to_tensor(obs),
                                     **{k: policy._obs_to_tensor(v) for k, v in state.items()})
        finally:
            weights.unpin(version)

    def scale_reward(self, reward: np.ndarray, done: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Time-major rewards ``[T, N]`` (numpy) as advantage estimators read them, by the newest published
        version (scaled when the policy normalises rewards, else as they are), and ``[T, N]`` values to hand to
        the learner with the batch (``discounted_return``, for :meth:`LearnMode.gather`), or None. ``done``
        ends an episode after its step."""
        policy, weights = self._policy, self._policy._weights
        version = weights.pin()
        try:
            return policy._scale_reward(Acting(version, self._memory), reward, done)
        finally:
            weights.unpin(version)


class EvalMode(_ActingView):
    """The evaluator's view of a policy: acts on the newest published version of the weights."""

    __slots__ = ()
    _name = "eval_mode"

    def forward(self, obs: Any) -> dict[str, Any]:
        """Greedy / deterministic actions (numpy ``[N, ...]``) for a batch of observations."""
        weights = self._policy._weights
        version = weights.pin()
        try:
            return _evaluate(self._policy, version, self._memory, obs)
        finally:
            weights.unpin(version)

    def snapshot(self) -> Snapshot:
        """An eval view pinned to the newest version, so a whole evaluation sees one version (see :class:`Snapshot`)."""
        return Snapshot(self._policy, "eval")


class Snapshot:
    """A collect or eval view pinned to one published version: every ``forward`` acts on it, however many
    versions are published meanwhile. It has its own per-env state (start it with ``reset()``), and
    ``state_dict()`` is the policy's checkpoint with this version's model weights (and version number) and
    the other parts as they are now. The version stays pinned (its copy is not recycled) while the snapshot
    is referenced.
    """

    __slots__ = ("_policy", "_version", "_mode", "_memory", "__weakref__")

    def __init__(self, policy: Viewed, mode: str) -> None:
        self._policy = policy
        self._version = policy._weights.pin()
        self._mode = mode
        self._memory: dict = {}
        weakref.finalize(self, policy._weights.unpin, self._version)

    @property
    def version(self) -> int:
        """The number of the version this snapshot acts on."""
        return self._version.number

    def forward(self, obs: Any, **kwargs: Any) -> dict[str, Any]:
        """As the view it was taken from (``collect_mode.forward`` / ``eval_mode.forward``), on this version."""
        if self._mode == "collect":
            return _collect(self._policy, self._version, self._memory, obs, kwargs)
        if kwargs:
            raise TypeError(f"an eval snapshot's forward takes only obs, got {sorted(kwargs)}")
        return _evaluate(self._policy, self._version, self._memory, obs)

    def reset(self, env_ids: Sequence[int] | None = None) -> None:
        """Forget this snapshot's per-env state of ``env_ids`` (all envs for ``None``)."""
        self._policy._reset(self._memory, env_ids)

    def state_dict(self) -> dict[str, Any]:
        """The policy's checkpoint whose model weights are exactly this version's (see :meth:`Policy.state_dict`)."""
        return self._policy._checkpoint(self._version)

    def model_state_dict(self) -> dict[str, Any]:
        """A copy of this version's model weights alone, as a dict (without the rest of :meth:`state_dict`)."""
        return {name: tensor.clone() for name, tensor in self._version.model.state_dict().items()}

    def __repr__(self) -> str:
        return f"<{self._mode} snapshot of {type(self._policy).__name__}, version {self.version}>"
