"""PPOPolicy's loss on hand-checkable inputs, its action distributions, lr annealing and checkpoints."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch

from conveyor.policy import PPOPolicy
from conveyor.schema import ConfigError
from policy_testing import TableActorCritic


def table_policy(logits=((0.0, 0.0),), values=(0.0,), **learn):
    learn = {"adv_norm": False, "value_coef": 0.0, "entropy_coef": 0.0, "grad_clip": None, **learn}
    return PPOPolicy({"model": {"action_shape": 2}, "learn": learn}, model=TableActorCritic(logits, values), seed=0)


def batch(**fields):
    n = len(fields["adv"])
    fields.setdefault("obs", [0] * n)
    fields.setdefault("action", [0] * n)
    fields.setdefault("value", [0.0] * n)
    fields.setdefault("return", [0.0] * n)
    fields.setdefault("reward", [0.0] * n)
    return ttorch.Tensor({k: torch.tensor(v, dtype=torch.int64 if k in ("obs", "action") else torch.float32)
                          for k, v in fields.items()})


HALF = math.log(0.5)  # log-probability of either action under logits (0, 0)


# --- clipped surrogate ---------------------------------------------------------------------------------
def test_ratio_above_the_clip_range_with_positive_advantage_is_clipped_and_gets_no_gradient():
    policy = table_policy(clip_ratio=0.2)
    out = policy.learn_mode.forward(batch(adv=[1.0], logp=[HALF - math.log(1.5)]))  # ratio 1.5
    assert out["losses/policy"] == pytest.approx(-1.2)
    assert out["charts/clip_frac"] == pytest.approx(1.0)
    assert policy.model.logits.detach().tolist() == [[0.0, 0.0]]  # the clipped term has zero gradient


def test_ratio_above_the_clip_range_with_negative_advantage_keeps_the_pessimistic_unclipped_term():
    policy = table_policy(clip_ratio=0.2)
    out = policy.learn_mode.forward(batch(adv=[-1.0], logp=[HALF - math.log(1.5)]))
    assert out["losses/policy"] == pytest.approx(1.5)
    assert policy.model.logits[0, 0].item() < 0.0  # pushed away from the disadvantaged action


def test_approx_kl_is_zero_at_ratio_one_and_the_low_variance_estimate_otherwise():
    policy = table_policy()
    assert policy.learn_mode.forward(batch(adv=[1.0], logp=[HALF]))["charts/approx_kl"] == pytest.approx(0.0)
    policy = table_policy()
    out = policy.learn_mode.forward(batch(adv=[1.0], logp=[HALF - math.log(2.0)]))  # ratio 2
    assert out["charts/approx_kl"] == pytest.approx((2.0 - 1.0) - math.log(2.0), rel=1e-5)


def test_advantages_are_normalised_per_minibatch_when_asked():
    data = batch(adv=[1.0, 3.0], logp=[HALF, HALF])  # ratio 1: the policy loss is -mean(adv)
    assert table_policy(adv_norm=False).learn_mode.forward(data)["losses/policy"] == pytest.approx(-2.0)
    assert table_policy(adv_norm=True).learn_mode.forward(data)["losses/policy"] == pytest.approx(0.0, abs=1e-6)


# --- value loss ------------------------------------------------------------------------------------------
def test_value_loss_is_half_the_squared_error():
    policy = table_policy(values=(2.0,), value_coef=0.5)
    out = policy.learn_mode.forward(batch(adv=[0.0], logp=[HALF], value=[0.0], **{"return": [3.0]}))
    assert out["losses/value"] == pytest.approx(0.5)


def test_value_clipping_takes_the_larger_loss_of_the_clipped_value():
    # new value 2 is clipped to 0 + 0.5 = 0.5 around the collected value 0: max((2-3)^2, (0.5-3)^2) / 2
    policy = table_policy(values=(2.0,), value_coef=0.5, value_clip=0.5)
    out = policy.learn_mode.forward(batch(adv=[0.0], logp=[HALF], value=[0.0], **{"return": [3.0]}))
    assert out["losses/value"] == pytest.approx(0.5 * 2.5**2)


def test_value_clipping_keeps_the_unclipped_loss_when_it_is_larger():
    # new value 2 against return 0: the clipped value 0.5 is closer, so the unclipped loss (2-0)^2 / 2 counts
    policy = table_policy(values=(2.0,), value_coef=0.5, value_clip=0.5)
    out = policy.learn_mode.forward(batch(adv=[0.0], logp=[HALF], value=[0.0], **{"return": [0.0]}))
    assert out["losses/value"] == pytest.approx(2.0)


# --- entropy ---------------------------------------------------------------------------------------------
def test_entropy_is_reported_and_its_bonus_flattens_the_policy():
    assert table_policy().learn_mode.forward(batch(adv=[0.0], logp=[HALF]))["losses/entropy"] == \
        pytest.approx(math.log(2.0))
    policy = table_policy(logits=((1.0, 0.0),), entropy_coef=0.1)
    before = policy.model.logits.detach().clone()
    policy.learn_mode.forward(batch(adv=[0.0], logp=[-0.3]))
    gap_before = (before[0, 0] - before[0, 1]).item()
    gap_after = (policy.model.logits[0, 0] - policy.model.logits[0, 1]).item()
    assert gap_after < gap_before


# --- learning rate, gradient clipping, metrics ----------------------------------------------------------
def test_the_learning_rate_is_what_the_trainer_set_as_a_fraction_of_the_configured_one():
    policy = table_policy(learning_rate=1e-3, lr_anneal_steps=4)
    policy.learn_mode.set_lr_factor(0.25)
    assert policy.learn_mode.forward(batch(adv=[1.0], logp=[HALF]))["charts/lr"] == pytest.approx(2.5e-4)
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)


def test_a_minibatch_past_the_target_kl_takes_no_step_and_asks_to_stop():
    policy = table_policy(target_kl=0.01)
    before = policy.model.logits.detach().clone()
    out = policy.learn_mode.forward(batch(adv=[1.0], logp=[math.log(0.9)]))  # far from the collecting policy
    assert out.early_stop is True and out["charts/approx_kl"] > 0.015
    assert torch.equal(policy.model.logits, before) and policy.learn_mode.train_iter == 0
    out = policy.learn_mode.forward(batch(adv=[1.0], logp=[HALF]))  # ratio 1: KL 0, the step is taken
    assert out.early_stop is False and policy.learn_mode.train_iter == 1


def test_constant_learning_rate_without_annealing():
    policy = table_policy(learning_rate=1e-3)
    lrs = [policy.learn_mode.forward(batch(adv=[1.0], logp=[HALF]))["charts/lr"] for _ in range(3)]
    assert lrs == pytest.approx([1e-3] * 3)


def test_metrics_are_namespaced_floats_with_grad_norm_when_clipping():
    policy = table_policy(grad_clip=0.5)
    out = policy.learn_mode.forward(batch(adv=[1.0], logp=[HALF])).metrics
    assert set(out) == {"losses/policy", "losses/value", "losses/entropy", "charts/approx_kl", "charts/clip_frac",
                        "charts/lr", "charts/grad_norm"}
    assert all(isinstance(v, float) for v in out.values())
    assert policy.learn_mode.train_iter == 1


# --- acting: distributions -------------------------------------------------------------------------------
def mlp_policy(action_space="discrete", obs_dim=3, action_shape=2, **model):
    cfg = {"model": {"obs_shape": obs_dim, "action_shape": action_shape, "action_space": action_space,
                     "hidden_sizes": [8], **model}}
    return PPOPolicy(cfg, seed=0)


def collected_batch(policy, obs):
    out = policy.collect_mode.forward(obs)
    n = len(obs)
    fields = {"obs": torch.from_numpy(obs), "logp": torch.from_numpy(out["logp"]),
              "value": torch.from_numpy(out["value"]), "adv": torch.ones(n), "return": torch.zeros(n),
              "reward": torch.zeros(n), "action": torch.from_numpy(out["action"])}
    if "raw_action" in out:
        fields["raw_action"] = torch.from_numpy(out["raw_action"])
    return out, ttorch.Tensor(fields)


@pytest.mark.parametrize("action_space", ["discrete", "gaussian", "tanh_gaussian"])
def test_the_learner_rescores_collected_actions_exactly(action_space):
    policy = mlp_policy(action_space, action_low=-2.0, action_high=2.0) if action_space != "discrete" \
        else mlp_policy()
    obs = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    out, data = collected_batch(policy, obs)
    assert {"action", "logp", "value"} <= set(out)
    metrics = policy.learn_mode.forward(data)
    assert metrics["charts/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["charts/clip_frac"] == 0.0


def test_categorical_sampling_follows_the_probabilities():
    policy = table_policy(logits=((math.log(0.2), math.log(0.8)),))
    actions = policy.collect_mode.forward(np.zeros(20000, np.int64))["action"]
    assert actions.mean() == pytest.approx(0.8, abs=0.02)
    assert policy.eval_mode.forward(np.zeros(3, np.int64))["action"].tolist() == [1, 1, 1]


def test_gaussian_actions_are_clipped_for_the_env_but_scored_unclipped():
    policy = mlp_policy("gaussian", action_shape=1, action_low=-0.1, action_high=0.1, init_log_std=0.0)
    obs = np.zeros((500, 3), np.float32)
    out = policy.collect_mode.forward(obs)
    assert np.abs(out["action"]).max() <= 0.1 + 1e-7 and np.abs(out["raw_action"]).max() > 1.0
    mean = policy.model(torch.from_numpy(obs))[0][0]
    expected = torch.distributions.Normal(mean, 1.0).log_prob(torch.from_numpy(out["raw_action"])).sum(-1)
    np.testing.assert_allclose(out["logp"], expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.eval_mode.forward(obs[:2])["action"],
                               mean[:2].clamp(-0.1, 0.1).detach().numpy(), atol=1e-7)


def test_tanh_gaussian_actions_are_squashed_into_the_bounds_with_the_change_of_variables():
    policy = mlp_policy("tanh_gaussian", action_shape=2, action_low=[0.0, -4.0], action_high=[1.0, 4.0])
    obs = np.random.default_rng(1).normal(size=(200, 3)).astype(np.float32)
    out = policy.collect_mode.forward(obs)
    action, raw = out["action"], torch.from_numpy(out["raw_action"])
    assert (action[:, 0] >= 0).all() and (action[:, 0] <= 1).all() and (np.abs(action[:, 1]) <= 4).all()
    np.testing.assert_allclose(action[:, 1], 4 * np.tanh(out["raw_action"][:, 1]), rtol=1e-5, atol=1e-6)
    mean, log_std = policy.model(torch.from_numpy(obs))[0]
    expected = (torch.distributions.Normal(mean, log_std.exp()).log_prob(raw)
                - torch.log(1 - torch.tanh(raw).pow(2))).sum(-1)
    np.testing.assert_allclose(out["logp"], expected.detach().numpy(), rtol=1e-4, atol=1e-4)


def test_state_dependent_std_comes_from_a_head():
    policy = mlp_policy("gaussian", state_dependent_std=True)
    assert not hasattr(policy.model, "log_std")
    _, log_std = policy.model(torch.randn(4, 3))[0]
    assert log_std.shape == (4, 2) and not torch.allclose(log_std[0], log_std[1])


def test_collecting_with_the_same_seed_is_reproducible():
    obs = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    torch.manual_seed(0)
    first = mlp_policy("gaussian").collect_mode.forward(obs)["action"]
    torch.manual_seed(0)
    second = mlp_policy("gaussian").collect_mode.forward(obs)["action"]
    np.testing.assert_array_equal(first, second)


# --- config ----------------------------------------------------------------------------------------------
def test_unknown_or_bad_keys_are_config_errors():
    with pytest.raises(ConfigError, match="did you mean 'policy.learn.clip_ratio'"):
        PPOPolicy({"model": {"obs_shape": 3, "action_shape": 2}, "learn": {"clip_ration": 0.1}})
    with pytest.raises(ConfigError, match="action_space"):
        PPOPolicy({"model": {"obs_shape": 3, "action_shape": 2, "action_space": "beta"}})


def test_grad_clip_can_be_turned_off():
    policy = PPOPolicy({"model": {"obs_shape": 3, "action_shape": 2}, "learn": {"grad_clip": None}})
    assert policy.cfg.learn.grad_clip is None
