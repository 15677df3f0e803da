"""PPO: clipped surrogate objective, optional value clipping, entropy bonus, discrete or continuous actions.

One ``learn_mode.forward(batch)`` is one gradient step on a minibatch that :func:`gae_estimator` and
:func:`multistep_trainer` (``conveyor.middleware``) prepared: ``obs``, ``action`` (or ``raw_action``),
``logp`` and ``value`` as collected, and the ``adv`` / ``return`` estimated from them. The loss reads
as in CleanRL's ``ppo.py``::

    ratio    = exp(log pi(a|s) - logp)
    pg_loss  = mean(max(-adv * ratio, -adv * clip(ratio, 1 - eps, 1 + eps)))
    v_loss   = 0.5 * mean((V(s) - return)^2)        (or the max with the clipped value's loss)
    loss     = pg_loss - entropy_coef * entropy + value_coef * v_loss

Options: per-minibatch advantage normalisation, gradient-norm clipping, linear learning-rate annealing by env
steps or rounds (the trainer sets it), an observation normaliser (running mean / std of collected observations),
and a GRU core whose per-env state the collector resets at episode ends and stores with each step
(``hidden`` before it, ``next_hidden`` after it), so the learner can replay sequences from it.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
import treetensor.torch as ttorch
from torch import nn

from conveyor import schema
from conveyor.data.batch import to_host
from conveyor.policy.actor_critic import ActorCritic, make_action_dist
from conveyor.policy.base import Policy
from conveyor.policy.learning import LazyOptimizer, LearnResult, fused_adam, masked_mean
from conveyor.policy.options import action_bound_check, optional_positive
from conveyor.policy.normaliser import FrozenNormaliser, ObsNormaliser, RewardNormaliser, RunningMeanStd
from conveyor.policy.views import ActorCriticCollectMode, ActorCriticLearnMode
from conveyor.policy.weights import Acting
from conveyor.schema import ConfigError, Option

__all__ = ["PPOPolicy", "clipped_surrogate"]


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip_ratio: float,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """PPO's clipped policy loss ``mean(max(-adv * ratio, -adv * clip(ratio, 1 - eps, 1 + eps)))`` over the entries
    where ``mask`` is 1 (all when None)."""
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    return masked_mean(torch.max(pg_loss1, pg_loss2), mask)


class PPOPolicy(Policy):
    """Proximal Policy Optimization (Schulman et al. 2017) over an :class:`ActorCritic`.

    - ``collect_mode.forward(obs)`` samples actions and returns ``action``, ``logp``, ``value``, plus
      ``raw_action`` for Gaussian policies (the unclipped / pre-squash sample the learner scores) and
      ``hidden`` / ``next_hidden`` for recurrent ones; ``collect_mode.value(obs, hidden=None)`` is the
      critic, for bootstrapping advantage estimates.
    - ``eval_mode.forward(obs)`` acts deterministically (argmax, or the Gaussian's mean).
    - ``learn_mode.forward(batch)`` takes one gradient step on a flat batch ``[B]`` or, for a recurrent
      policy, on sequences ``[L, B]`` (with ``hidden``, ``episode_start`` and ``mask``), and returns
      ``losses/policy``, ``losses/value``, ``losses/entropy``, ``charts/approx_kl``, ``charts/clip_frac``,
      ``charts/lr`` and (when clipping) ``charts/grad_norm``.

    A custom ``model`` follows :class:`ActorCritic`: ``forward(obs, hidden=None) -> (params, value,
    hidden)``, ``actor(obs)``, ``value(obs, hidden=None)`` and, when ``recurrent``, ``unroll(obs, hidden,
    episode_start)`` and ``hidden_size``.

    With ``model.obs_norm`` every view normalises observations with running statistics of the
    collected ones. The statistics stay fixed while a rollout is collected and learned from: what the
    collector saw is folded in when it starts collecting again after an update (so the first ratio of
    every update is exactly 1), and they are saved in checkpoints. With ``model.reward_norm`` the advantage
    estimator reads rewards scaled by the running std of each env's discounted return (``collect_mode.scale_reward``),
    statistics kept by the same rule; the learner gathers both from each round's batch where a replica collected it
    (``learn_mode.gather``).
    """

    @classmethod
    def config_schema(cls) -> dict:
        """Base options plus PPO's (defaults close to Stable-Baselines3's PPO; the zoo entries tune them)."""
        return schema.merge_schemas(super().config_schema(), {
            "gae_lambda": Option(0.95, "GAE lambda: 0 gives one-step TD advantages, 1 Monte Carlo returns minus the "
                                       "value (read by gae_estimator).", type=float, check=schema.unit_interval),
            "model": {
                "action_shape": Option(None, "Number of discrete actions, or the action dimension for continuous "
                                             "control (set from the env).", type=int, check=optional_positive),
                "action_space": Option("discrete", "Action distribution: 'discrete' (categorical), 'gaussian' "
                                                   "(diagonal Gaussian, clipped to the bounds for the env) or "
                                                   "'tanh_gaussian' (squashed into the bounds).",
                                       choices=("discrete", "gaussian", "tanh_gaussian")),
                "action_low": Option(None, "Lower action bound: a float or one per dim (set from a Box env; None: "
                                           "unbounded for 'gaussian', -1 for 'tanh_gaussian').",
                                     type=(float, list), check=action_bound_check),
                "action_high": Option(None, "Upper action bound: a float or one per dim (set from a Box env; None: "
                                            "unbounded for 'gaussian', 1 for 'tanh_gaussian').",
                                      type=(float, list), check=action_bound_check),
                "activation": Option("tanh", "Activation of the hidden layers of vector-observation encoders.",
                                     choices=("tanh", "relu")),
                "share_encoder": Option(False, "One encoder for actor and critic (always so with an rnn)."),
                "state_dependent_std": Option(False, "Gaussian log-std from a head over the features (else one "
                                                     "learned parameter per action dim)."),
                "init_log_std": Option(0.0, "Initial log-std of a state-independent Gaussian.", type=float),
                "rnn": Option(None, "Recurrent core after the encoder: 'gru', or None for a feed-forward policy.",
                              choices=(None, "gru")),
                "rnn_hidden_size": Option(64, "Width of the recurrent state.", check=schema.positive),
                "obs_norm": Option(False, "Normalise observations by a running mean / std of the collected ones."),
                "obs_norm_clip": Option(10.0, "Clip normalised observations to +-this.", type=float,
                                        check=schema.positive),
                "reward_norm": Option(False, "Scale rewards by the running std of each env's discounted return "
                                             "(Stable-Baselines3 VecNormalize's norm_reward); logged returns stay "
                                             "raw."),
                "reward_norm_clip": Option(10.0, "Clip scaled rewards to +-this.", type=float, check=schema.positive),
            },
            "learn": {
                "epoch_per_collect": Option(10, "Passes over each collected batch (multistep_trainer).",
                                            check=schema.positive),
                "batch_size": Option(64, "Transitions per minibatch (multistep_trainer); sequences of a recurrent "
                                         "policy come batch_size // sequence_length at a time.",
                                     check=schema.positive),
                "learning_rate": Option(3e-4, "Adam learning rate (the start value when annealed).", type=float,
                                        check=schema.positive),
                "lr_anneal_steps": Option(None, "Anneal the learning rate linearly to 0 over this many lr_anneal_unit "
                                                "(None: constant); the trainer sets it before each round.", type=int,
                                          check=optional_positive),
                "lr_anneal_unit": Option("env_step", "What lr_anneal_steps counts: 'env_step' (ctx.env_step when a "
                                                     "round starts) or 'iteration' (training rounds); never gradient "
                                                     "steps, whose number early stopping varies.",
                                         choices=("env_step", "iteration")),
                "clip_ratio": Option(0.2, "Clip the probability ratio to [1 - clip_ratio, 1 + clip_ratio].",
                                     type=float, check=schema.positive),
                "value_clip": Option(None, "Also clip the new value to within this of the collected one and take the "
                                           "larger of the two losses (None: plain value loss).", type=float,
                                     check=optional_positive),
                "value_coef": Option(0.5, "Weight of the value loss.", type=float, check=schema.non_negative),
                "entropy_coef": Option(0.0, "Weight of the entropy bonus.", type=float, check=schema.non_negative),
                "target_kl": Option(None, "End a round's passes once a minibatch's approx_kl under the current policy "
                                          "exceeds 1.5 * target_kl, before stepping on it (Stable-Baselines3's rule; "
                                          "None: run every epoch).", type=float,
                                    check=optional_positive),
                "adv_norm": Option(True, "Normalise advantages to zero mean, unit std within each minibatch (all "
                                         "of it, over data-parallel learners' shares)."),
                "grad_clip": Option(0.5, "Clip the gradient's global L2 norm to this (None: no clipping).",
                                    type=(float, type(None)), check=optional_positive),
                "sequence_length": Option(16, "Recurrent policies: steps per replayed sequence (gae_estimator cuts "
                                              "each env's trajectory into these).", check=schema.positive),
            },
            "collect": {
                "n_sample": Option(1024, "Transitions collected per rollout (over all envs).", check=schema.positive),
            },
        })

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any], observation_space: Any, action_space: Any) -> None:
        """The action distribution fits the env's action space, and a minibatch fits in one rollout."""
        policy = cfg["policy"]
        cls._check_action_head(cfg, action_space)
        batch_size, n_sample = policy["learn"]["batch_size"], policy["collect"]["n_sample"]
        if batch_size > n_sample:
            raise ConfigError(f"config key 'policy.learn.batch_size' ({batch_size}) is larger than the "
                              f"{n_sample} transitions collected per rollout (policy.collect.n_sample): lower "
                              f"batch_size or raise n_sample")

    @classmethod
    def _check_action_head(cls, cfg: Mapping[str, Any], action_space: Any) -> None:
        """``policy.model.action_space`` fits the env's action space (Discrete for 'discrete', else Box)."""
        head = cfg["policy"]["model"]["action_space"]
        if head == "discrete":
            cls._require_action_space(cfg, action_space, "Discrete", "set policy.model.action_space='gaussian' "
                                      "(or 'tanh_gaussian') for continuous actions")
        else:
            cls._require_action_space(cfg, action_space, "Box", f"policy.model.action_space='{head}' is for "
                                      "continuous actions: set it to 'discrete'")

    @classmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """An :class:`ActorCritic` as ``model_cfg`` describes it."""
        obs_shape = cls._required(model_cfg, "obs_shape", "obs_shape=4 for CartPole")
        action_dim = cls._required(model_cfg, "action_shape", "action_shape=2 for CartPole")
        return ActorCritic(obs_shape, action_dim, action_space=model_cfg.action_space,
                           hidden_sizes=model_cfg.hidden_sizes, activation=model_cfg.activation,
                           share_encoder=model_cfg.share_encoder,
                           rnn_hidden_size=model_cfg.rnn_hidden_size if model_cfg.rnn else None,
                           state_dependent_std=model_cfg.state_dependent_std, init_log_std=model_cfg.init_log_std,
                           encoder_kind=model_cfg.encoder)

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        super().__init__(cfg, model, device=device, seed=seed)
        self._collect_mode = ActorCriticCollectMode(self)
        self._learn_mode = ActorCriticLearnMode(self)
        model_cfg, learn = self.cfg.model, self.cfg.learn
        action_dim = model_cfg.action_shape if model_cfg.action_shape is not None else self.model.action_dim
        try:
            self.action_dist = make_action_dist(model_cfg.action_space, action_dim, model_cfg.action_low,
                                                model_cfg.action_high, self.device)
        except ValueError as exc:
            raise ConfigError(f"policy.model.action_low/action_high: {exc}") from None
        self.recurrent = getattr(self.model, "recurrent", False)
        self.obs_normaliser: ObsNormaliser | None = None
        if model_cfg.obs_norm:
            obs_shape = model_cfg.obs_shape
            if obs_shape is None or isinstance(obs_shape, Mapping):
                raise ConfigError("policy.model.obs_norm needs an array observation (obs_shape an int or a tuple), got "
                                  f"obs_shape={obs_shape!r}: normalise Dict observations in an env wrapper instead")
            self.obs_normaliser = ObsNormaliser(obs_shape, clip=model_cfg.obs_norm_clip)
            self.register_state("obs_normaliser", self.obs_normaliser)
        self.reward_normaliser: RewardNormaliser | None = None
        if model_cfg.reward_norm:
            self.reward_normaliser = RewardNormaliser(self.cfg.discount_factor, clip=model_cfg.reward_norm_clip)
            self.register_state("reward_normaliser", self.reward_normaliser)
        self._committed_at = 0  # train_iter when the normalisers last folded in collected data
        self.optimizer = LazyOptimizer(torch.optim.Adam, self.model, lr=learn.learning_rate, eps=1e-5,
                                       fused=fused_adam(self.device))
        self.register_state("optimizer", self.optimizer)
        self._parameters = list(self.model.parameters())

    # --- observations and recurrent state --------------------------------------------------------
    def _normalise(self, obs: Any) -> Any:
        """Observations as the learner sees them: normalised by the live statistics."""
        return obs if self.obs_normaliser is None else self.obs_normaliser(obs)

    def _acting_extras(self) -> Any:
        """The observation and reward statistics acting uses, frozen with each published version. Publishing after
        an update first folds the data collected since the last fold into them, so a rollout is acted on, valued,
        scaled and learned from with one set of statistics (the first ratio of every update is exactly 1)."""
        obs_norm, reward_norm = self.obs_normaliser, self.reward_normaliser
        if obs_norm is None and reward_norm is None:
            return None
        if self.train_iter != self._committed_at:
            for normaliser in (obs_norm, reward_norm):
                if normaliser is not None:
                    normaliser.commit()
            self._committed_at = self.train_iter
        frozen = obs_norm.frozen(self.device) if obs_norm is not None else FrozenNormaliser(None, None, None)
        if reward_norm is not None:
            frozen.reward_scale, frozen.reward_clip = reward_norm.scale(), reward_norm.clip
        return frozen

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint; observations it holds as gathered stay uncommitted until the next update."""
        with self._learn_lock:
            committed_at = self._committed_at
            self._committed_at = int(state_dict.get("counters", {}).get("train_iter", 0))
            try:
                super().load_state_dict(state_dict)
            except Exception:
                self._committed_at = committed_at
                raise

    def _initial_state(self, state: torch.Tensor | None, batch: int) -> torch.Tensor:
        if state is None or state.shape[0] != batch:
            return torch.zeros(batch, self.model.hidden_size, device=self.device)
        return state

    @staticmethod
    def _cleared(state: torch.Tensor | None, env_ids: Sequence[int] | None) -> torch.Tensor | None:
        """``state`` with the rows of ``env_ids`` zeroed, out of place: arrays handed out earlier stay intact."""
        if state is None or env_ids is None:
            return None
        ids = torch.as_tensor(list(env_ids), dtype=torch.long, device=state.device)
        return state.index_fill(0, ids, 0.0)

    def _reset(self, memory: dict, env_ids: Sequence[int] | None) -> None:
        """Zero the recurrent state of envs whose episodes ended."""
        memory["hidden"] = self._cleared(memory.get("hidden"), env_ids)

    # --- acting ----------------------------------------------------------------------------------
    def _forward_collect(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """Sampled actions with their log-probabilities and values (and the recurrent state around the step); with
        ``obs_norm``, ``obs_gathered``: whether the observations went into this policy's statistics (a replica's
        do not: the learner gathers them from the batch)."""
        out: dict[str, Any] = {}
        if self.obs_normaliser is not None:
            if not self._replica:
                self.obs_normaliser.observe(obs)  # gathered for the fold at the next publish
            out["obs_gathered"] = np.full(obs.shape[0], not self._replica)
            obs = acting.extras(obs)
        model = acting.model
        kept: dict[str, torch.Tensor] = {}
        if self.recurrent:
            hidden = self._initial_state(acting.memory.get("hidden"), obs.shape[0])
            params, value, next_hidden = model(obs, hidden)
            acting.memory["hidden"] = next_hidden
            kept.update(hidden=hidden, next_hidden=next_hidden)
        else:
            params, value, _ = model(obs)
        action, raw_action, logp = self.action_dist.sample(params, self.rng)
        kept.update(action=action, logp=logp, value=value)
        if raw_action is not None:
            kept["raw_action"] = raw_action
        out.update(zip(kept, to_host(*kept.values())))  # one trip back from the device per step
        return out

    def _greedy(self, acting: Acting, obs: Any) -> torch.Tensor:
        """Deterministic actions: the most likely discrete action, or the Gaussian's mean (clipped / squashed)."""
        if acting.extras is not None:
            obs = acting.extras(obs)
        if self.recurrent:
            hidden = self._initial_state(acting.memory.get("hidden"), obs.shape[0])
            params, _, acting.memory["hidden"] = acting.model(obs, hidden)
        else:
            params = acting.model.actor(obs)  # the critic is not needed to act
        return self.action_dist.mode(params)

    def _scale_reward(self, acting: Acting, reward: np.ndarray,
                      done: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """With ``model.reward_norm``: the rewards ``[T, N]`` scaled by the statistics published with ``acting``'s
        version, and the envs' discounted returns through them (for :meth:`_gather` on the learner's side)."""
        if self.reward_normaliser is None:
            return reward, None
        return acting.extras.scale_reward(reward), self.reward_normaliser.discount(reward, done)

    def _collect_state(self) -> dict[str, Any]:
        """With ``model.reward_norm``: each env's discounted return so far (where a replica collects, only it has them)."""
        if self.reward_normaliser is None:
            return {}
        return {"discounted_returns": self.reward_normaliser.state_dict()["returns"]}

    def _load_collect_state(self, state: Mapping[str, Any]) -> None:
        if self.reward_normaliser is not None and "discounted_returns" in state:
            self.reward_normaliser.load_returns(state["discounted_returns"])

    def _gather(self, batch: Any) -> None:
        """Take a round's ``discounted_return`` into the reward statistics, and the observations a replica collected
        (``obs_gathered`` False) into the observation statistics, real steps only (by ``mask``), to be folded in at
        the publish after the update: so the statistics grow alike wherever the batch was collected. Among
        data-parallel learners each gathers what every learner's share holds (:meth:`_group_stats`), so their
        statistics stay the same."""
        real = batch.mask.bool() if "mask" in batch else None
        if self.reward_normaliser is not None and "discounted_return" in batch:
            returns = batch.discounted_return
            returns = (returns if real is None else returns[real]).cpu().numpy()
            if self._data_parallel is None:
                self.reward_normaliser.gather(returns)
            else:
                for stats in self._group_stats(returns, ()):
                    self.reward_normaliser.gather_stats(stats)
        if self.obs_normaliser is not None and "obs_gathered" in batch:
            rows = ~batch.obs_gathered.bool() if real is None else ~batch.obs_gathered.bool() & real
            if self._data_parallel is not None:  # every learner takes part, with or without rows of its own
                shape = self.obs_normaliser.shape
                for stats in self._group_stats(batch.obs[rows].double().cpu().numpy(), shape):
                    self.obs_normaliser.observe_stats(stats)
            elif bool(rows.any()):
                self.obs_normaliser.observe(batch.obs[rows])

    def _group_stats(self, values: np.ndarray, shape: Sequence[int]) -> list[RunningMeanStd]:
        """The statistics of every data-parallel learner's ``values`` (rows of ``shape``), in rank order: one
        all-gather, and the same list on every learner."""
        local = RunningMeanStd(shape)
        local.update(values)
        packed = torch.from_numpy(local.pack()).to(self._data_parallel.device)
        every = self._data_parallel.all_gather(packed, "an all-gather of normaliser statistics").cpu().numpy()
        return [RunningMeanStd.unpack(row, shape) for row in every]

    def _value(self, acting: Acting, obs: Any, hidden: torch.Tensor | None = None) -> np.ndarray:
        """The critic's values of ``obs`` (after the recurrent state ``hidden``)."""
        if acting.extras is not None:
            obs = acting.extras(obs)
        if self.recurrent:
            if hidden is None:
                raise ValueError("PPOPolicy.collect_mode.value: a recurrent policy needs hidden= (the state before "
                                 "obs, e.g. the trajectory's next_hidden)")
            return to_host(acting.model.value(obs, hidden.float()))[0]
        return to_host(acting.model.value(obs))[0]

    # --- learning --------------------------------------------------------------------------------
    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
        """One PPO gradient step on a minibatch (flat ``[B]``, or sequences ``[L, B]`` for a recurrent policy).

        With ``learn.target_kl`` set, the minibatch's approximate KL under the current policy is checked first:
        above ``1.5 * target_kl`` no step is taken and the result has ``early_stop = True``.
        """
        learn = self.cfg.learn
        lr = self.optimizer.param_groups[0]["lr"]
        obs = self._normalise(batch.obs)
        if self.recurrent:
            if batch.reward.ndim != 2 or "episode_start" not in batch:
                raise ValueError("PPOPolicy: a recurrent policy learns from sequences [L, B] with hidden, "
                                 "episode_start and mask (gae_estimator writes them from trajectories that carry "
                                 "'hidden')")
            params, new_value = self.model.unroll(obs, batch.hidden[0].float(), batch.episode_start)
        else:
            params, new_value, _ = self.model(obs)
        mask = batch.mask.float() if "mask" in batch else None
        action = batch[self.action_dist.raw_key] if self.action_dist.raw_key else batch.action

        new_logp, entropy = self.action_dist.log_prob_entropy(params, action)
        logratio = new_logp - batch.logp
        ratio = logratio.exp()

        adv = batch.adv
        if learn.adv_norm:
            if self._data_parallel is not None:  # over the whole batch, as one learner would
                adv_mean, adv_std = self._data_parallel.mean_std(adv, mask)
            elif mask is None:
                adv_std, adv_mean = torch.std_mean(adv, correction=0)
            else:
                adv_mean = masked_mean(adv, mask)
                adv_std = masked_mean((adv - adv_mean).pow(2), mask).sqrt()
            adv = (adv - adv_mean) / (adv_std + 1e-8)

        pg_loss = clipped_surrogate(ratio, adv, learn.clip_ratio, mask)

        v_loss_unclipped = (new_value - batch["return"]).pow(2)
        if learn.value_clip is not None:
            v_clipped = batch.value + (new_value - batch.value).clamp(-learn.value_clip, learn.value_clip)
            v_loss_clipped = (v_clipped - batch["return"]).pow(2)
            v_loss = 0.5 * masked_mean(torch.max(v_loss_unclipped, v_loss_clipped), mask)
        else:
            v_loss = 0.5 * masked_mean(v_loss_unclipped, mask)

        entropy_loss = masked_mean(entropy, mask)
        loss = pg_loss - learn.entropy_coef * entropy_loss + learn.value_coef * v_loss

        with torch.no_grad():
            kl_terms = (ratio - 1.0) - logratio  # the low-variance estimator of KL(old || new)
            # among data-parallel learners, over the whole minibatch: every learner decides the early stop alike
            approx_kl = (masked_mean(kl_terms, mask) if self._data_parallel is None
                         else self._data_parallel.mean(kl_terms, mask))
            clip_frac = masked_mean(((ratio - 1.0).abs() > learn.clip_ratio).float(), mask)
            metrics = torch.stack([pg_loss, v_loss, entropy_loss, approx_kl, clip_frac]).tolist()
        out: dict[str, Any] = dict(zip(("losses/policy", "losses/value", "losses/entropy", "charts/approx_kl",
                                        "charts/clip_frac"), metrics))
        out["charts/lr"] = float(lr)
        if learn.target_kl is not None and out["charts/approx_kl"] > 1.5 * learn.target_kl:
            return LearnResult(out, early_stop=True)  # moved far enough from the collecting policy: no step here
        return self._gradient_step(loss, self.optimizer, self._parameters, out)
