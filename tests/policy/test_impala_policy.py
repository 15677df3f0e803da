"""IMPALAPolicy: what acting records, the V-trace loss on hand-checkable unrolls, policy lag, config and checkpoints."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch

from conveyor.policy import IMPALAPolicy
from conveyor.schema import ConfigError
from policy_testing import TableActorCritic

HALF = math.log(0.5)  # log-probability of either action under logits (0, 0)


def table_policy(logits=((0.0, 0.0),), values=(0.0,), **learn):
    learn = {"value_coef": 0.0, "entropy_coef": 0.0, "grad_clip": None, **learn}
    return IMPALAPolicy({"model": {"action_shape": 2}, "learn": learn}, model=TableActorCritic(logits, values), seed=0)


def unrolls(reward, logp=None, obs=None, terminated=None, truncated=None, next_obs=None, weight_version=None):
    """Unrolls ``[B, T]`` from nested lists (state 0 and action 0 unless given)."""
    reward = torch.tensor(reward, dtype=torch.float32)
    fields = {
        "reward": reward,
        "obs": torch.zeros_like(reward, dtype=torch.int64) if obs is None else torch.tensor(obs),
        "next_obs": torch.zeros_like(reward, dtype=torch.int64) if next_obs is None else torch.tensor(next_obs),
        "action": torch.zeros_like(reward, dtype=torch.int64),
        "logp": torch.full_like(reward, HALF) if logp is None else torch.tensor(logp, dtype=torch.float32),
        "terminated": torch.zeros_like(reward, dtype=torch.bool) if terminated is None else torch.tensor(terminated),
        "truncated": torch.zeros_like(reward, dtype=torch.bool) if truncated is None else torch.tensor(truncated),
    }
    if weight_version is not None:
        fields["weight_version"] = torch.tensor(weight_version, dtype=torch.int64)
    return ttorch.Tensor(fields)


def test_collecting_records_the_behaviour_log_probability_and_the_acting_version():
    policy = IMPALAPolicy({"model": {"obs_shape": 4, "action_shape": 2}}, seed=0)
    policy.publish()
    out = policy.collect_mode.forward(np.zeros((3, 4), dtype=np.float32))
    assert out["logp"].shape == (3,) and np.all(out["logp"] <= 0)
    assert out["weight_version"].tolist() == [policy.version] * 3


def test_on_policy_terminated_step_has_the_reward_minus_the_value_as_advantage():
    policy = table_policy(values=(0.25,), value_coef=1.0)
    out = policy.learn_mode.forward(unrolls([[1.0]], terminated=[[True]]))
    # vs = r = 1; pg_adv = 1 - 0.25; pg_loss = -pg_adv * log pi(a); v_loss = 0.5 * (0.25 - 1)^2
    assert out["losses/policy"] == pytest.approx(-0.75 * HALF)
    assert out["losses/value"] == pytest.approx(0.5 * 0.75 ** 2)
    assert out["charts/rho_mean"] == pytest.approx(1.0) and out["charts/rho_clip_frac"] == 0.0


def test_the_last_step_of_an_unroll_bootstraps_from_its_next_observation():
    policy = table_policy(values=(0.0, 2.0), value_coef=1.0)
    out = policy.learn_mode.forward(unrolls([[0.0]], obs=[[0]], next_obs=[[1]]))
    gamma = policy.cfg.discount_factor
    assert out["losses/value"] == pytest.approx(0.5 * (gamma * 2.0) ** 2)


def test_a_stale_behaviour_policy_is_corrected_by_the_clipped_importance_weight():
    policy = table_policy(rho_bar=1.5)
    out = policy.learn_mode.forward(unrolls([[1.0]], logp=[[math.log(0.125)]], terminated=[[True]]))  # ratio 4
    assert out["charts/rho_mean"] == pytest.approx(1.5) and out["charts/rho_clip_frac"] == 1.0
    assert out["losses/policy"] == pytest.approx(-1.5 * 1.0 * HALF)


def test_policy_lag_counts_versions_published_since_the_batch_was_acted():
    policy = table_policy()
    acted = policy.publish()
    for _ in range(3):
        policy.publish()
    out = policy.learn_mode.forward(unrolls([[1.0, 0.0]], weight_version=[[acted, acted + 2]]))
    assert out["charts/policy_lag"] == pytest.approx(2.0) and out["charts/policy_lag_max"] == 3.0


def test_learning_raises_the_probability_of_the_rewarded_action():
    policy = table_policy(learning_rate=0.05)
    batch = unrolls([[1.0, 1.0], [1.0, 1.0]], terminated=[[True, True], [True, True]])
    for _ in range(20):
        policy.learn_mode.forward(batch)
    probs = torch.softmax(policy.model.logits[0].detach(), -1)
    assert probs[0] > 0.7


def test_ppo_only_options_are_refused_and_rnn_too():
    with pytest.raises(ConfigError, match="clip_ratio"):
        IMPALAPolicy({"model": {"obs_shape": 4, "action_shape": 2}, "learn": {"clip_ratio": 0.2}})
    with pytest.raises(ConfigError, match="feed-forward"):
        IMPALAPolicy({"model": {"obs_shape": 4, "action_shape": 2, "rnn": "gru"}})
    schema = IMPALAPolicy.config_schema()
    assert {"rho_bar", "c_bar", "publish_every"} <= set(schema["learn"]) and "gae_lambda" not in schema


def test_a_flat_batch_is_refused_with_what_to_give():
    policy = table_policy()
    flat = ttorch.Tensor({"reward": torch.zeros(3), "obs": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"unrolls \[B, T\]"):
        policy.learn_mode.forward(flat)


def test_a_checkpoint_restores_weights_optimizer_and_counters():
    policy = IMPALAPolicy({"model": {"obs_shape": 1, "action_shape": 2, "hidden_sizes": [8]}}, seed=0)
    batch = unrolls([[1.0, 0.0]])
    batch.obs = torch.zeros(1, 2, 1)
    batch.next_obs = torch.zeros(1, 2, 1)
    policy.learn_mode.forward(batch)
    saved = policy.state_dict()
    other = IMPALAPolicy({"model": {"obs_shape": 1, "action_shape": 2, "hidden_sizes": [8]}}, seed=1)
    other.load_state_dict(saved)
    assert other.train_iter == 1
    a, b = policy.learn_mode.forward(batch), other.learn_mode.forward(batch)
    assert a["losses/value"] == pytest.approx(b["losses/value"])


def small_policy(seed):
    return IMPALAPolicy({"model": {"obs_shape": 1, "action_shape": 2, "hidden_sizes": [8]}}, seed=seed)


def learn_batch():
    batch = unrolls([[1.0, 0.0]])
    batch.obs, batch.next_obs = torch.zeros(1, 2, 1), torch.zeros(1, 2, 1)
    return batch


def acting_logits(policy):
    return policy.collect_mode.snapshot().model_state_dict()["actor_head.weight"]


def test_a_resumed_policy_acts_on_the_version_published_before_the_checkpoint_not_the_live_weights():
    policy = small_policy(0)
    published = policy.publish()
    policy.learn_mode.forward(learn_batch())  # live weights move on; collectors still act on `published`
    resumed = small_policy(1)
    resumed.load_state_dict(policy.state_dict())
    assert resumed.version == published
    torch.testing.assert_close(acting_logits(resumed), acting_logits(policy))
    torch.testing.assert_close(resumed.model.actor_head.weight, policy.model.actor_head.weight)  # learning goes on


def test_a_checkpoint_of_an_evaluated_version_acts_on_that_version():
    policy = small_policy(0)
    evaluated = policy.eval_mode.snapshot()
    policy.learn_mode.forward(learn_batch())
    policy.publish()
    loaded = small_policy(1)
    loaded.load_state_dict(evaluated.state_dict())
    assert loaded.version == evaluated.version
    torch.testing.assert_close(acting_logits(loaded), evaluated.state_dict()["model"]["actor_head.weight"])
