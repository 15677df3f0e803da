"""What the off-policy actor-critics for 1-D ``Box`` actions share (SAC, TD3, IQL, continuous CQL).

:class:`QActorCriticPolicy` holds an actor, an :class:`~conveyor.policy.continuous.EnsembleQ` of critics with
a Polyak-averaged target copy, the env's action bounds, one Adam optimizer for the actor and one for the
critics, their config options, the critics' regression step, and the learning step's frame: a subclass writes
the update as :meth:`QActorCriticPolicy._learn_tensors` (tensors in, tensors out), which on CUDA is replayed from a
CUDA graph when its schema has ``learn.cuda_graph`` (:mod:`conveyor.policy.cuda_graph`). Subclasses build the
actor and act with it.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Hashable, Iterator, Mapping

import torch
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.policy.base import Policy
from conveyor.policy.continuous import ActionScaler
from conveyor.policy.cuda_graph import CudaGraphStep, scalars
from conveyor.policy.learning import LazyOptimizer, LearnResult, TargetSync, fused_adam, make_target
from conveyor.policy.options import (action_bound_check, hidden_sizes_check, lr_option, nstep_option,
                                     replay_buffer_schema, with_defaults)
from conveyor.schema import ConfigError, Option

__all__ = ["QActorCriticPolicy", "TorchGeneratorState"]


def _theta_check(value: Any) -> str | None:
    return None if 0 < value <= 1 else "must be in (0, 1]"


def _action_dim_check(value: Any) -> str | None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    return None if ok else "must be the action dimension of a 1-D Box action space (an int > 0)"


class TorchGeneratorState:
    """Checkpoints a ``torch.Generator`` (the learner's sampling noise) so a resumed run continues exactly.

    CPU and CUDA generators are different algorithms with different states: a state saved on the other kind of
    device seeds this generator from its bytes instead, so a checkpoint moves between devices (deterministically,
    but not with the same draws)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.get_state(), "device": self.generator.device.type}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = state_dict["state"]
        saved_on = state_dict.get("device", "cuda" if state.numel() == 16 else "cpu")  # older checkpoints: by size
        if saved_on == self.generator.device.type:
            self.generator.set_state(state)
        else:
            self.generator.manual_seed(int.from_bytes(hashlib.sha256(state.numpy().tobytes()).digest()[:8], "little"))


class QActorCriticPolicy(Policy):
    """An actor and ``critic_num`` critics over ``(obs, action in [-1, 1])`` with a target copy, for 1-D ``Box``
    actions in the bounds ``model.action_low`` / ``model.action_high`` (``compile_config`` fills them from the
    env). The model has an ``actor`` and a ``critic`` (``forward(obs, action) -> [critic_num, B]``).
    Subclasses write ``build_model``, acting and ``_forward_learn``. Checkpointed: ``model``,
    ``target_critic``, ``actor_optimizer``, ``critic_optimizer``, the exploration ``rng`` and ``train_iter``.
    """

    @classmethod
    def config_schema(cls) -> dict:
        """Base options plus the actor's and critics' (defaults are the SAC paper's: 256x256, lr 3e-4, batch 256)."""
        base = super().config_schema()
        changed = with_defaults(base, {"learn": {"batch_size": 256, "learning_starts": 1000},
                                       "collect": {"n_sample": 8}})
        return schema.merge_schemas(base, changed, {
            "nstep": nstep_option(),
            "model": {
                "action_shape": Option(None, "Action dimension of the 1-D Box action space (set from the env).",
                                       type=int, check=_action_dim_check),
                "action_low": Option(None, "Lower action bound: a float or one per dim (set from the env; None: -1).",
                                     type=(float, list, tuple), check=action_bound_check),
                "action_high": Option(None, "Upper action bound: a float or one per dim (set from the env; None: 1).",
                                      type=(float, list, tuple), check=action_bound_check),
                "hidden_sizes": Option([256, 256], "Widths of the hidden layers of the actor and of each critic.",
                                       type=list, check=hidden_sizes_check),
                "critic_num": Option(2, "Critics in the ensemble; targets and the actor use their minimum.",
                                     check=schema.positive),
            },
            "learn": {
                "learning_rate": Option(3e-4, "Adam learning rate of every network (unless set apiece below).",
                                        type=float, check=schema.positive),
                "actor_learning_rate": lr_option("actor"),
                "critic_learning_rate": lr_option("critic"),
                "target_theta": Option(0.005, "Soft target update rate (Polyak tau) per target update.",
                                       type=float, check=_theta_check),
            },
            "collect": {
                "random_collect_size": Option(5000, "Env steps of uniformly random actions before the policy acts "
                                                    "(the pipeline passes it to StepCollector).",
                                              check=schema.non_negative),
            },
            "other": {
                "replay_buffer": replay_buffer_schema(1_000_000),
            },
        })

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any], observation_space: Any, action_space: Any) -> None:
        """A 1-D Box action space."""
        cls._require_action_space(cfg, action_space, "Box", "use DQN or PPO for discrete actions")

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        learn, model_cfg = self.cfg.learn, self.cfg.model
        if not (isinstance(getattr(self.model, "actor", None), nn.Module)
                and isinstance(getattr(self.model, "critic", None), nn.Module)):
            raise TypeError(f"{type(self).__name__} needs a model with an 'actor' and a 'critic' (forward(obs, "
                            f"action) -> [critic_num, B]), such as {type(self).build_model.__qualname__}'s; got "
                            f"{type(self.model).__name__}")
        self.actor: nn.Module = self.model.actor
        self.critic: nn.Module = self.model.critic
        self.target_critic = make_target(self.critic)
        self._target_sync = TargetSync(self.target_critic, self.critic)
        action_dim = self._required(model_cfg, "action_shape", "action_shape=1 for Pendulum")
        try:
            self.action_scaler = ActionScaler(action_dim, model_cfg.action_low, model_cfg.action_high,
                                              device=self.device)
        except ValueError as exc:
            raise ConfigError(f"policy.model.action_low/action_high: {exc}") from None
        self.action_dim = action_dim
        # Made capturable (their step counters on the GPU), the optimizers can step inside a CUDA graph.
        self._graphed = self.device.type == "cuda" and bool(learn.get("cuda_graph", False))
        self._graph_step: CudaGraphStep | None = None
        self._learn_generators: list[torch.Generator] = []
        lr = learn.learning_rate
        self.actor_optimizer = self._adam(self.actor, learn.actor_learning_rate or lr)
        self.critic_optimizer = self._adam(self.critic, learn.critic_learning_rate or lr)
        self.register_state("target_critic", self.target_critic)
        self.register_state("actor_optimizer", self.actor_optimizer)
        self.register_state("critic_optimizer", self.critic_optimizer)
        self._actor_params = list(self.actor.parameters())
        self._critic_params = list(self.critic.parameters())

    def _adam(self, module: nn.Module, lr: float) -> LazyOptimizer:
        """A lazily made Adam over ``module``'s parameters: fused where it can be, capturable for CUDA graphs."""
        options = {"capturable": True} if self._graphed else {}
        return LazyOptimizer(torch.optim.Adam, module, lr=lr, fused=fused_adam(self.device), **options)

    def _learn_rng(self) -> torch.Generator:
        """A generator for the learner's noise, on the policy's device, checkpointed as ``learn_rng`` (and advanced
        by CUDA graph replays as by eager steps)."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(self.rng.integers(0, 2**62)))
        self.register_state("learn_rng", TorchGeneratorState(generator))
        self._learn_generators.append(generator)
        return generator

    def _data_action(self, batch: ttorch.Tensor) -> torch.Tensor:
        """The batch's actions (in the env's bounds) mapped to ``[-1, 1]``, as ``[B, action_dim]``."""
        return self.action_scaler.from_env(batch.action).reshape(-1, self.action_dim)

    # --- learning --------------------------------------------------------------------------------
    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
        """One update (:meth:`_learn_tensors`), replayed from a CUDA graph where ``learn.cuda_graph`` holds, with
        its metrics as floats (read in one copy from the device)."""
        variant = self._learn_variant()
        if self._graphed and self._data_parallel is None:  # a group's all-reduce cannot run inside a graph
            if self._graph_step is None:
                self._graph_step = CudaGraphStep(self._learn_tensors, generators=self._learn_generators)
            lr_factors = tuple(c.lr_factor for c in self._stateful.values() if isinstance(c, LazyOptimizer))
            metrics, td_error = self._graph_step(batch, variant, key=lr_factors)  # a graph bakes its learning rates in
        else:
            metrics, td_error = self._learn_tensors(batch, variant)
        self.train_iter += 1
        return self._learn_result(scalars(metrics), batch, td_error)

    def _learn_variant(self) -> Hashable:
        """What decides, before a step, which path :meth:`_learn_tensors` takes (TD3: whether the actor steps this
        time); each value gets its own CUDA graph. None here: every step takes the same path."""
        return None

    def _learn_tensors(self, batch: ttorch.Tensor,
                       variant: Hashable) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The update on one flat batch, on the device alone (graph-safe: no ``.item()``, no branch on a tensor's
        value): its scalar metrics by name, and the TD errors ``[critic_num, B]`` for new priorities."""
        raise NotImplementedError(f"{type(self).__name__} writes _learn_tensors or its own _forward_learn")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint; captured CUDA graphs are dropped (loading an optimizer replaces its tensors)."""
        super().load_state_dict(state_dict)
        if self._graph_step is not None:
            self._graph_step.reset()

    def _critic_step(self, batch: ttorch.Tensor, action: torch.Tensor,
                     target_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor | None]:
        """One gradient step of every critic regressing ``Q_i(s, a)`` on ``target_q`` (squared error summed over
        critics, weighted per sample by the batch's ``weight`` under prioritized replay), plus
        :meth:`_extra_critic_losses`. Returns ``q`` ``[critic_num, B]``, the TD errors, the loss metrics
        (``losses/q`` and the extra terms, as tensors) and the gradient norm when clipped."""
        q = self.critic(batch.obs, action)  # [critic_num, B]
        td_error = q - target_q
        per_sample = td_error.pow(2).sum(0)
        q_loss = (per_sample * batch.weight).mean() if "weight" in batch else per_sample.mean()
        extra = self._extra_critic_losses(batch, action, q)
        critic_loss = q_loss + sum(extra.values()) if extra else q_loss
        grad_norm = self._apply_gradients(critic_loss, self.critic_optimizer, self._critic_params)
        losses = {"losses/q": q_loss.detach(), **{name: term.detach() for name, term in extra.items()}}
        return q.detach(), td_error.detach(), losses, grad_norm

    @staticmethod
    def _learn_result(metrics: dict[str, float], batch: ttorch.Tensor, td_error: torch.Tensor) -> LearnResult:
        """``metrics`` as a :class:`LearnResult`, with each sample's mean ``|TD error|`` over the critics as its
        new priority when the batch is prioritized (carries ``weight``)."""
        prioritized = "weight" in batch
        return LearnResult(metrics, priorities=td_error.abs().mean(0).cpu().numpy() if prioritized else None)

    def _extra_critic_losses(self, batch: ttorch.Tensor, action: torch.Tensor,
                             q: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss terms added to the critics' TD loss, by metric name, from the batch, its actions in ``[-1, 1]``
        and their Q-values ``q`` ``[critic_num, B]`` (none here; conservative Q-learning adds its penalty)."""
        return {}

    @contextlib.contextmanager
    def _critic_frozen(self) -> Iterator[None]:
        """The critics' weights take no gradient inside (while the actor's loss goes through them)."""
        self.critic.requires_grad_(False)
        try:
            yield
        finally:
            self.critic.requires_grad_(True)
