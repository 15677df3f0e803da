"""IMPALA (Espeholt et al. 2018): an actor-critic that learns from unrolls acted by older versions of its weights,
corrected by V-trace (:mod:`conveyor.policy.vtrace`).

Collectors act with whichever version they last received and record, with every step, the behaviour
log-probability of the action (``logp``) and the number of the version that chose it (``weight_version``). One
``learn_mode.forward(batch)`` is one gradient step on a batch of unrolls ``[B, T]`` (``B`` trajectories of ``T``
consecutive steps of one env each, as ``conveyor.middleware.UnrollLearner`` hands them over). The loss reads::

    vs, pg_adv = vtrace(logp, log pi(a|s), reward, V(s), V(s'), gamma * (1 - terminated), done, rho_bar, c_bar)
    pg_loss      = -mean(pg_adv * log pi(a|s))
    v_loss       = 0.5 * mean((V(s) - vs)^2)
    entropy_loss = mean(entropy of pi(.|s))
    loss         = pg_loss + value_coef * v_loss - entropy_coef * entropy_loss

The network, action distributions, observation normaliser, optimizer and checkpoint are :class:`PPOPolicy`'s.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import treetensor.torch as ttorch
import treevalue

from conveyor import schema
from conveyor.data.batch import flatten_batch
from conveyor.policy.learning import LearnResult, masked_mean
from conveyor.policy.options import optional_positive
from conveyor.policy.ppo import PPOPolicy
from conveyor.policy.vtrace import vtrace
from conveyor.schema import ConfigError, Option

__all__ = ["IMPALAPolicy"]

_PPO_ONLY_LEARN = ("epoch_per_collect", "clip_ratio", "value_clip", "target_kl", "adv_norm", "sequence_length")
"""Options of PPO's update that IMPALA's has no use for (its schema drops them)."""


class IMPALAPolicy(PPOPolicy):
    """IMPALA's learner and actors over an :class:`~conveyor.policy.ActorCritic` (feed-forward).

    - ``collect_mode.forward(obs)`` samples actions and returns ``action``, ``logp`` (the behaviour
      log-probability V-trace corrects with), ``value`` and ``weight_version`` (the version that acted).
    - ``eval_mode.forward(obs)`` acts deterministically (argmax, or the Gaussian's mean).
    - ``learn_mode.forward(batch)`` takes one gradient step on unrolls ``[B, T]`` holding ``obs``, ``action`` (or
      ``raw_action``), ``logp``, ``reward``, ``terminated``, ``truncated``, ``next_obs`` and optionally ``valid``
      and ``weight_version``, and returns ``losses/policy``, ``losses/value``, ``losses/entropy``,
      ``charts/rho_mean`` (the clipped importance weights' mean), ``charts/rho_clip_frac`` (the share of steps
      whose ratio exceeded ``rho_bar``), ``charts/policy_lag`` / ``charts/policy_lag_max`` (how many versions
      the newest published one is past those that acted, mean and max over the batch), ``charts/lr`` and
      (when clipping) ``charts/grad_norm``.

    An episode that terminates inside an unroll cuts V-trace's bootstrap there; one that was truncated (or the
    unroll's last step) bootstraps from the value of its ``next_obs`` under the current weights.
    """

    learns_on_policy = False
    """Learns from data acted by older versions: distributed collectors never wait for fresh weights."""

    @classmethod
    def config_schema(cls) -> dict:
        """PPO's network options and IMPALA's update (PPO's clipped-surrogate options and ``gae_lambda`` dropped)."""
        base = super().config_schema()
        del base["gae_lambda"]
        for key in _PPO_ONLY_LEARN:
            del base["learn"][key]
        return schema.merge_schemas(base, {
            "learn": {
                "batch_size": Option(8, "Unrolls (each one env's n_sample / collector_env_num consecutive steps) per "
                                        "gradient step; UnrollLearner batches them from whichever collectors sent "
                                        "them.", check=schema.positive),
                "learning_rate": Option(6e-4, "Adam learning rate (the start value when annealed).", type=float,
                                        check=schema.positive),
                "rho_bar": Option(1.0, "Clip of V-trace's importance weights on the TD errors and the policy "
                                       "gradient: bounds which policy's value is learned (None: unclipped).",
                                  type=float, check=optional_positive),
                "c_bar": Option(1.0, "Clip of V-trace's trace-cutting weights: bounds how far back a TD error "
                                     "reaches (None: unclipped).", type=float, check=optional_positive),
                "value_coef": Option(0.5, "Weight of the baseline (value) loss.", type=float,
                                     check=schema.non_negative),
                "entropy_coef": Option(0.01, "Weight of the entropy bonus.", type=float, check=schema.non_negative),
                "grad_clip": Option(40.0, "Clip the gradient's global L2 norm to this (None: no clipping).",
                                    type=(float, type(None)), check=optional_positive),
                "replay_ratio": Option(0, "Sample reuse: gradient steps on unrolls drawn from a FIFO replay of recent "
                                          "ones after each step on fresh ones (each unroll is learned from 1 + this "
                                          "many times on average; V-trace corrects for their age). 0: each once.",
                                       check=schema.non_negative),
                "replay_size": Option(64, "Unrolls the replay keeps (the newest; used when replay_ratio > 0).",
                                      check=schema.positive),
                "publish_every": Option(4, "Publish the weights (which distributed collectors then receive) every "
                                           "this many gradient steps (UnrollLearner), not after every batch.",
                                        check=schema.positive),
            },
            "collect": {
                "n_sample": Option(256, "Transitions per collector call over all its envs: each env's unroll is "
                                        "n_sample / collector_env_num steps.", check=schema.positive),
            },
        })

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any], observation_space: Any, action_space: Any) -> None:
        """The action distribution fits the env's action space; the network is feed-forward and rewards raw."""
        cls._check_action_head(cfg, action_space)
        model = cfg["policy"]["model"]
        for key, value in (("rnn", model.get("rnn")), ("reward_norm", model.get("reward_norm"))):
            if value:
                raise ConfigError(f"config key 'policy.model.{key}' is {value!r}, but IMPALAPolicy learns with a "
                                  f"feed-forward network from raw rewards: leave it unset (PPOPolicy has it)")

    def __init__(self, cfg: Mapping[str, Any], model: Any = None, *, device: Any = None,
                 seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        if self.recurrent:
            raise ConfigError("IMPALAPolicy learns with a feed-forward network: give a model whose recurrent is False")
        self._published = _PublishedWeights(self)
        self.register_state("published", self._published)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint; collectors act on the version that was published when it was taken (weights
        published every few steps lag the live ones), so a resumed run acts as the uninterrupted one did. A
        checkpoint of one version's weights (``eval_best``, whose counters name that version) acts on them."""
        with self._learn_lock:
            super().load_state_dict(state_dict)
            acting, self._published.loaded = self._published.loaded, None
            if acting is None or int(acting["version"]) != int(state_dict["counters"].get("version", 0)):
                return  # saved from another version than the one published then: its model weights act
            live = [t.detach().clone() for t in (*self.model.parameters(), *self.model.buffers())]
            self._weights.load(acting)  # publishes the saved version (its weights pass through the model)
            with torch.no_grad():
                torch._foreach_copy_([*self.model.parameters(), *self.model.buffers()], live)

    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
        """One gradient step on unrolls ``[B, T]`` with V-trace targets."""
        learn = self.cfg.learn
        if batch.reward.ndim != 2:
            raise ValueError(f"IMPALAPolicy learns from unrolls [B, T]; got reward of shape {tuple(batch.reward.shape)} "
                             f"(UnrollLearner cuts the collectors' [T, N] trajectories into them)")
        traj = treevalue.mapping(batch, lambda x: x.transpose(0, 1))  # time-major [T, B], as V-trace runs
        steps, width = traj.reward.shape
        action_key = self.action_dist.raw_key or "action"
        params, value, _ = self.model(self._normalise(flatten_batch(traj.obs, 2)))
        logp, entropy = self.action_dist.log_prob_entropy(params, flatten_batch(traj[action_key], 2))
        value, logp, entropy = (x.reshape(steps, width) for x in (value, logp, entropy))

        terminated, truncated = traj.terminated.bool(), traj.truncated.bool()
        valid = traj.valid.bool() if "valid" in traj else torch.ones_like(terminated)
        with torch.no_grad():
            next_value = torch.zeros_like(value)
            next_value[:-1] = value[1:]
            cut = truncated.clone()
            cut[-1] = True  # the unroll ends: bootstrap from its last next_obs
            bootstrap = cut & ~terminated & valid
            if bool(bootstrap.any()):
                next_value[bootstrap] = self.model.value(self._normalise(traj.next_obs[bootstrap]))
            discount = self.cfg.discount_factor * (~terminated).to(value.dtype)
            targets = vtrace(traj.logp, logp, traj.reward.to(value.dtype), value, next_value, discount,
                             truncated | ~valid, rho_bar=learn.rho_bar, c_bar=learn.c_bar)

        mask = valid.to(value.dtype)
        pg_loss = -masked_mean(targets.pg_advantage * logp, mask)
        v_loss = 0.5 * masked_mean((value - targets.vs).pow(2), mask)
        entropy_loss = masked_mean(entropy, mask)
        loss = pg_loss + learn.value_coef * v_loss - learn.entropy_coef * entropy_loss

        with torch.no_grad():
            rho_bar = learn.rho_bar if learn.rho_bar is not None else float("inf")
            clipped = (logp - traj.logp).exp() > rho_bar
            metrics = torch.stack([pg_loss, v_loss, entropy_loss, masked_mean(targets.rho, mask),
                                   masked_mean(clipped.to(mask.dtype), mask)]).tolist()
        out: dict[str, Any] = dict(zip(("losses/policy", "losses/value", "losses/entropy", "charts/rho_mean",
                                        "charts/rho_clip_frac"), metrics))
        out.update(self._policy_lag(traj))
        out["charts/lr"] = float(self.optimizer.param_groups[0]["lr"])
        return self._gradient_step(loss, self.optimizer, self._parameters, out)

    def _policy_lag(self, traj: ttorch.Tensor) -> dict[str, float]:
        """How many versions the newest published one is past those that acted the batch (rows a version chose)."""
        if "weight_version" not in traj:
            return {}
        acted = traj.weight_version[traj.weight_version >= 0]  # -1: random warm-up actions
        if not len(acted):
            return {}
        lag = (self.version - acted).float()
        return {"charts/policy_lag": lag.mean().item(), "charts/policy_lag_max": lag.max().item()}


class _PublishedWeights:
    """The newest published version (``acting_state``) in a checkpoint: published every ``publish_every`` steps, it
    lags the live weights the checkpoint's ``model`` holds."""

    def __init__(self, policy: IMPALAPolicy) -> None:
        self._policy = policy
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self._policy.acting_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = dict(state)
