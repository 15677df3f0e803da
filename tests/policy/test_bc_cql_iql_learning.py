"""What every offline policy (BC, discrete and continuous CQL, IQL) does alike: a learn step on a batch shaped like
the replay buffer's changes the weights, and a checkpoint round trip continues exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.policy import BCPolicy, CQLPolicy, DiscreteCQLPolicy, IQLPolicy
from policy_testing import offline_batch, through_bytes

MODEL = {"obs_shape": 3, "action_shape": 2, "hidden_sizes": [16, 16]}
CASES = {
    "bc_discrete": (BCPolicy, {"model": MODEL}, True),
    "bc_continuous": (BCPolicy, {"model": {**MODEL, "action_space": "continuous", "action_low": -2.0,
                                           "action_high": 2.0}}, False),
    "cql_discrete": (DiscreteCQLPolicy, {"model": MODEL}, True),
    "cql_continuous": (CQLPolicy, {"model": {**MODEL, "action_low": -2.0, "action_high": 2.0},
                                   "learn": {"cql_n_actions": 3}}, False),
    "iql": (IQLPolicy, {"model": {**MODEL, "action_low": -2.0, "action_high": 2.0}}, False),
}


def batch(case: str, seed: int):
    discrete = CASES[case][2]
    return offline_batch(seed, discrete=discrete, low=-2.0, high=2.0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_learn_step_changes_the_weights_and_reports_finite_losses(case):
    cls, cfg, _ = CASES[case]
    policy = cls(cfg, seed=0)
    before = [p.detach().clone() for p in policy.model.parameters()]
    out = policy.learn_mode.forward(batch(case, 0)).metrics
    assert policy.learn_mode.train_iter == 1
    assert all(np.isfinite(v) for v in out.values()) and any(k.startswith("losses/") for k in out)
    changed = [not torch.equal(a, b) for a, b in zip(before, policy.model.parameters())]
    assert all(changed) if cls is BCPolicy else sum(changed) >= len(changed) // 2


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_state_dict_round_trip_continues_exactly(case):
    cls, cfg, _ = CASES[case]
    trained = cls(cfg, seed=1)
    for i in range(3):
        trained.learn_mode.forward(batch(case, i))
    resumed = cls(cfg, seed=2)
    resumed.load_state_dict(through_bytes(trained.state_dict()))
    assert resumed.learn_mode.train_iter == 3
    assert trained.learn_mode.forward(batch(case, 9)) == resumed.learn_mode.forward(batch(case, 9))
    for x, y in zip(trained.model.parameters(), resumed.model.parameters()):
        assert torch.equal(x, y)
    obs = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    trained.learn_mode.publish()
    resumed.learn_mode.publish()
    np.testing.assert_array_equal(trained.eval_mode.forward(obs)["action"], resumed.eval_mode.forward(obs)["action"])
    kwargs = {"eps": 0.5} if cls is DiscreteCQLPolicy else {}  # DQN's exploration rate
    np.testing.assert_array_equal(trained.collect_mode.forward(obs, **kwargs)["action"],
                                  resumed.collect_mode.forward(obs, **kwargs)["action"])
