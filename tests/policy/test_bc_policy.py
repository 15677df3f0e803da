"""BCPolicy through its views: what it regresses on, what it acts with, and which env it accepts."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor.config import compile_config
from conveyor.policy import BCPolicy
from conveyor.schema import ConfigError


def test_discrete_loss_is_the_cross_entropy_of_the_data_action():
    policy = BCPolicy({"model": {"obs_shape": 2, "action_shape": 3, "hidden_sizes": [4]}}, seed=0)
    with torch.no_grad():
        policy.model.head.weight.zero_()
        policy.model.head.bias.copy_(torch.tensor([0.0, math.log(2.0), 0.0]))  # softmax (1/4, 1/2, 1/4)
    batch = ttorch.Tensor({"obs": torch.randn(2, 2), "action": torch.tensor([1, 2])})
    out = policy.learn_mode.forward(batch)
    assert out["losses/bc"] == pytest.approx(0.5 * (math.log(2.0) + math.log(4.0)), rel=1e-6)
    assert out["charts/accuracy"] == 0.5


def test_continuous_bc_regresses_the_action_in_the_envs_bounds():
    torch.manual_seed(0)
    policy = BCPolicy({"model": {"obs_shape": 1, "action_shape": 1, "action_space": "continuous", "hidden_sizes": [16],
                                 "action_low": -2.0, "action_high": 2.0}, "learn": {"learning_rate": 1e-2}}, seed=0)
    obs = torch.linspace(-1, 1, 64).reshape(-1, 1)
    batch = ttorch.Tensor({"obs": obs, "action": 1.5 * obs})  # a = 1.5 s, within [-2, 2]
    for _ in range(500):
        out = policy.learn_mode.forward(batch)
    policy.learn_mode.publish()
    assert out["losses/bc"] < 1e-3
    action = policy.eval_mode.forward(np.array([[0.5], [-1.0]], np.float32))["action"]
    np.testing.assert_allclose(action, [[0.75], [-1.5]], atol=0.05)


def test_discrete_collect_samples_the_softmax_and_eval_takes_its_argmax():
    policy = BCPolicy({"model": {"obs_shape": 1, "action_shape": 2, "hidden_sizes": [4]}}, seed=0)
    with torch.no_grad():
        policy.model.head.weight.zero_()
        policy.model.head.bias.copy_(torch.tensor([0.0, math.log(3.0)]))  # P(action 1) = 3/4
    obs = np.zeros((4000, 1), np.float32)
    assert (policy.eval_mode.forward(obs)["action"] == 1).all()
    assert policy.collect_mode.forward(obs)["action"].mean() == pytest.approx(0.75, abs=0.03)


def test_an_action_head_that_does_not_fit_the_env_is_a_config_error():
    cfg = EasyDict(env={"env_id": "Pendulum-v1"}, policy={})
    with pytest.raises(ConfigError, match="action_space='continuous'"):
        compile_config(cfg, policy=BCPolicy)
    cfg.policy = {"model": {"action_space": "continuous"}}
    assert compile_config(cfg, policy=BCPolicy).policy.model.action_high == 2.0
