"""IQL's expectile loss against hand-computed values, and what one learn step regresses on."""
from __future__ import annotations

import math

import pytest
import torch
import treetensor.torch as ttorch

from conveyor.policy import IQLPolicy, expectile_loss


def test_expectile_loss_weights_positive_errors_by_tau_and_negative_by_one_minus_tau():
    diff = torch.tensor([2.0, -1.0])
    assert expectile_loss(diff, 0.7).item() == pytest.approx((0.7 * 4.0 + 0.3 * 1.0) / 2)
    assert expectile_loss(diff, 0.5).item() == pytest.approx((0.5 * 4.0 + 0.5 * 1.0) / 2)
    assert expectile_loss(torch.tensor([-3.0]), 0.9).item() == pytest.approx(0.1 * 9.0)


def test_expectile_loss_minimiser_is_the_expectile():
    """Over samples {0, 1}, the tau-expectile v solves tau (1 - v) = (1 - tau) v, i.e. v = tau."""
    samples = torch.tensor([0.0, 1.0])
    v = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.SGD([v], lr=0.5)
    for _ in range(200):
        optimizer.zero_grad()
        expectile_loss(samples - v, 0.8).backward()
        optimizer.step()
    assert v.item() == pytest.approx(0.8, abs=1e-4)


def test_one_learn_step_reports_the_value_critic_and_actor_terms_by_hand():
    policy = IQLPolicy({"discount_factor": 0.5, "model": {"obs_shape": 1, "action_shape": 1, "hidden_sizes": [8],
                                                          "critic_num": 1},
                        "learn": {"expectile": 0.9, "beta": 2.0, "max_weight": 1.5}}, seed=0)
    with torch.no_grad():  # V = 0 and Q' = 0 everywhere: the terms follow by hand
        for p in policy.value.parameters():
            p.zero_()
        policy.target_critic.net[-1].weight.zero_()
        policy.target_critic.net[-1].bias.zero_()
    batch = ttorch.Tensor({"obs": torch.zeros(2, 1), "next_obs": torch.zeros(2, 1),
                           "action": torch.tensor([[1.0], [-1.0]]),
                           "reward": torch.tensor([1.0, 2.0]), "terminated": torch.tensor([False, True]),
                           "truncated": torch.zeros(2, dtype=torch.bool)})
    with torch.no_grad():
        q = policy.critic(batch.obs, batch.action)[0]
        mean, log_std = policy.actor(batch.obs)
        log_prob = torch.distributions.Normal(torch.tanh(mean), log_std.exp()).log_prob(batch.action).sum(-1)
    out = policy.learn_mode.forward(batch)
    assert out["losses/value"] == pytest.approx(0.0)  # target Q' = 0 = V
    # Critics regress on r + 0.5 * (1 - terminated) * V(s') = r, V(s') = 0 before the step.
    assert out["losses/q"] == pytest.approx(((q - torch.tensor([1.0, 2.0])) ** 2).mean().item(), rel=1e-5)
    # Advantages are 0, so every weight is exp(0) = 1 (under max_weight): plain log-likelihood.
    assert out["charts/weight_mean"] == pytest.approx(1.0)
    assert out["losses/actor"] == pytest.approx(-log_prob.mean().item(), rel=1e-5)


def test_advantage_weights_are_clipped_at_max_weight():
    policy = IQLPolicy({"model": {"obs_shape": 1, "action_shape": 1, "hidden_sizes": [8], "critic_num": 1},
                        "learn": {"beta": 1.0, "max_weight": 1.5}}, seed=0)
    with torch.no_grad():
        for p in policy.value.parameters():
            p.zero_()
        policy.target_critic.net[-1].weight.zero_()
        policy.target_critic.net[-1].bias.fill_(math.log(4.0))  # advantage log 4: weight 4, clipped to 1.5
    batch = ttorch.Tensor({"obs": torch.zeros(2, 1), "next_obs": torch.zeros(2, 1), "action": torch.zeros(2, 1),
                           "reward": torch.zeros(2), "terminated": torch.ones(2, dtype=torch.bool),
                           "truncated": torch.zeros(2, dtype=torch.bool)})
    out = policy.learn_mode.forward(batch)
    assert out["charts/advantage_mean"] == pytest.approx(math.log(4.0), rel=1e-5)
    assert out["charts/weight_mean"] == pytest.approx(1.5)


def test_cosine_actor_lr_decay_follows_train_iter_to_zero_and_leaves_the_other_rates():
    policy = IQLPolicy({"model": {"obs_shape": 2, "action_shape": 1, "hidden_sizes": [4]},
                        "learn": {"learning_rate": 1e-3, "actor_lr_decay": "cosine", "max_train_iter": 4}}, seed=0)
    batch = ttorch.Tensor({"obs": torch.zeros(4, 2), "next_obs": torch.zeros(4, 2), "action": torch.zeros(4, 1),
                           "reward": torch.ones(4), "terminated": torch.zeros(4, dtype=torch.bool),
                           "truncated": torch.zeros(4, dtype=torch.bool)})
    rates = []
    for _ in range(5):
        policy.learn_mode.forward(batch)
        rates.append(policy.actor_optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi * min(k, 4) / 4)) for k in range(5)])
    assert policy.critic_optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
