"""The learning step's typed result and the lazy optimizers: what a learner gets back, and what an acting-only
policy never makes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from easydict import EasyDict

from conveyor.policy import DQNPolicy, LazyOptimizer, LearnResult, PPOPolicy


def dqn(seed: int = 0) -> DQNPolicy:
    return DQNPolicy(EasyDict(model=dict(obs_shape=4, action_shape=2, hidden_sizes=[8])), seed=seed)


def batch(seed: int, weight: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    out = {"obs": rng.normal(size=(8, 4)).astype(np.float32), "next_obs": rng.normal(size=(8, 4)).astype(np.float32),
           "action": rng.integers(0, 2, 8), "reward": rng.normal(size=8).astype(np.float32),
           "terminated": np.zeros(8, bool), "truncated": np.zeros(8, bool)}
    if weight:
        out["weight"] = np.ones(8, np.float32)
    return out


def optimizers(policy) -> list[LazyOptimizer]:
    return [c for c in policy._stateful.values() if isinstance(c, LazyOptimizer)]


# --- LearnResult -------------------------------------------------------------------------------------------
def test_a_learn_step_returns_metrics_and_priorities_as_fields():
    policy = dqn()
    plain, weighted = policy.learn_mode.forward(batch(0)), policy.learn_mode.forward(batch(1, weight=True))
    assert isinstance(plain, LearnResult) and plain.priorities is None and plain.early_stop is False
    assert plain["losses/td"] == plain.metrics["losses/td"] and "losses/td" in plain
    assert weighted.priorities.shape == (8,) and "priority" not in weighted.metrics


def test_reading_an_old_key_names_the_field_to_read_instead():
    result = LearnResult({"losses/td": 1.0}, priorities=np.ones(2))
    with pytest.raises(KeyError, match="result.priorities"):
        result["priority"]
    with pytest.raises(KeyError, match="result.early_stop"):
        result["early_stop"]
    with pytest.raises(TypeError):
        iter(result)


def test_results_compare_by_value_priorities_included():
    assert LearnResult({"a": 1.0}, np.arange(3.0)) == LearnResult({"a": 1.0}, np.arange(3.0))
    assert LearnResult({"a": 1.0}, np.arange(3.0)) != LearnResult({"a": 1.0}, np.ones(3))
    assert LearnResult({"a": 1.0}) != LearnResult({"a": 1.0}, early_stop=True)


def test_a_hook_may_return_a_dict_of_metrics_but_not_the_old_keys():
    assert LearnResult.of({"losses/x": 2.0}, "here") == LearnResult({"losses/x": 2.0})
    with pytest.raises(TypeError, match="LearnResult.*'priority'"):
        LearnResult.of({"losses/x": 2.0, "priority": np.ones(2)}, "here")
    with pytest.raises(TypeError, match="LearnResult"):
        LearnResult.of([1.0], "here")


# --- lazy optimizers ---------------------------------------------------------------------------------------
def test_a_policy_that_only_acts_and_checkpoints_makes_no_optimizer():
    policy = dqn()
    policy.collect_mode.forward(np.zeros((2, 4), np.float32), eps=0.5)
    policy.eval_mode.forward(np.zeros((2, 4), np.float32))
    policy.eval_mode.snapshot().state_dict()
    replica = dqn(seed=1)
    replica.load_state_dict(policy.state_dict())
    assert replica.state_dict()["optimizer"] == {"state": {}}
    assert not any(opt.made for p in (policy, replica) for opt in optimizers(p))


def test_a_checkpoint_loaded_before_the_optimizer_is_made_goes_on_exactly():
    trained = dqn()
    for i in range(3):
        trained.learn_mode.forward(batch(i))
    saved = trained.state_dict()
    replica = dqn(seed=5)
    replica.load_state_dict(saved)
    assert not replica.optimizer.made
    assert replica.state_dict()["optimizer"]["state"].keys() == saved["optimizer"]["state"].keys()  # kept, not made
    assert trained.learn_mode.forward(batch(9)) == replica.learn_mode.forward(batch(9))  # Adam's moments came back


def test_a_fresh_checkpoint_makes_a_made_optimizer_fresh_again():
    policy = dqn()
    fresh = dqn().state_dict()
    policy.learn_mode.forward(batch(0))
    policy.load_state_dict(fresh)
    assert not policy.optimizer.made and policy.state_dict()["optimizer"] == {"state": {}}
    assert policy.optimizer.state_dict()["state"] == {}  # made on use, with nothing learned


def test_a_learning_rate_factor_set_before_the_optimizer_is_made_applies_when_it_is():
    policy = PPOPolicy(EasyDict(model=dict(obs_shape=4, action_shape=2), learn=dict(learning_rate=1e-3)))
    policy.set_lr_factor(0.25)
    assert not policy.optimizer.made
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)
    policy.set_lr_factor(0.5)
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert isinstance(policy.optimizer.optimizer, torch.optim.Adam)
