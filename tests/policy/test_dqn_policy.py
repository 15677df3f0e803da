"""DQNPolicy through its public views: TD targets, target networks, PER, exploration, checkpoints."""
from __future__ import annotations


import copy

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch

from conveyor.data.batch import as_tree
from conveyor.policy import DQNPolicy
from conveyor.schema import ConfigError
from policy_testing import TableQ, through_bytes, transitions

GAMMA = 0.9


def table_policy(table, **learn) -> DQNPolicy:
    """A DQN over a hand-set Q-table (state 0 acts, state 1 is the next state)."""
    cfg = {"discount_factor": GAMMA, "learn": {"loss": "mse", **learn}}
    return DQNPolicy(cfg, model=TableQ(table), seed=0)


def targets(policy: DQNPolicy, **fields) -> np.ndarray:
    """The TD targets of a batch whose Q(obs, action) is 0, read back as its ``|TD error|`` priorities."""
    batch = transitions(weight=[1.0] * len(fields["reward"]), **fields)
    return policy.learn_mode.forward(batch).priorities


# --- TD target -------------------------------------------------------------------------------------
def test_truncated_transition_bootstraps_and_terminated_does_not():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]])
    target = targets(policy, obs=[0, 0, 0], action=[0, 0, 0], reward=[1.0, 1.0, 1.0], next_obs=[1, 1, 1],
                     terminated=[True, False, False], truncated=[False, True, False])
    np.testing.assert_allclose(target, [1.0, 1.0 + GAMMA * 3.0, 1.0 + GAMMA * 3.0], rtol=1e-6)


def test_batch_discount_from_nstep_replaces_discount_factor():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]])
    target = targets(policy, obs=[0, 0], action=[0, 1], reward=[2.0, 2.0], next_obs=[1, 1],
                     terminated=[False, False], truncated=[False, False], discount=[0.5, 0.25])
    np.testing.assert_allclose(target, [2.0 + 0.5 * 3.0, 2.0 + 0.25 * 3.0], rtol=1e-6)


def test_nstep_config_without_batch_discount_is_an_error():
    policy = DQNPolicy({"nstep": 3}, model=TableQ([[0.0, 0.0], [1.0, 3.0]]))
    batch = transitions(obs=[0], action=[0], reward=[1.0], next_obs=[1], terminated=[False], truncated=[False])
    with pytest.raises(ValueError, match="n-step enhancer"):
        policy.learn_mode.forward(batch)


def test_double_dqn_values_online_argmax_with_target_network():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]], double=True)
    with torch.no_grad():
        policy.target_model.table[1] = torch.tensor([5.0, 2.0])  # online argmax is 1, target's is 0
    target = targets(policy, obs=[0], action=[0], reward=[1.0], next_obs=[1], terminated=[False], truncated=[False])
    np.testing.assert_allclose(target, [1.0 + GAMMA * 2.0], rtol=1e-6)


def test_plain_dqn_values_target_networks_own_max():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]], double=False)
    with torch.no_grad():
        policy.target_model.table[1] = torch.tensor([5.0, 2.0])
    target = targets(policy, obs=[0], action=[0], reward=[1.0], next_obs=[1], terminated=[False], truncated=[False])
    np.testing.assert_allclose(target, [1.0 + GAMMA * 5.0], rtol=1e-6)


def test_metrics_are_namespaced_floats():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]])
    batch = transitions(obs=[0], action=[0], reward=[1.0], next_obs=[1], terminated=[True], truncated=[False])
    out = policy.learn_mode.forward(batch).metrics
    assert set(out) == {"losses/td", "charts/q_mean", "charts/target_q_mean"}
    assert all(isinstance(v, float) for v in out.values())
    assert out["charts/target_q_mean"] == pytest.approx(1.0)
    assert out["losses/td"] == pytest.approx(1.0)  # mse of q=0 against target 1


def test_gradient_norm_is_reported_when_clipping():
    cfg = {"model": {"obs_shape": 4, "action_shape": 2}, "learn": {"grad_clip": 0.5}}
    out = DQNPolicy(cfg, seed=0).learn_mode.forward(_cartpole_like_batch(0))
    assert out["charts/grad_norm"] > 0.0


# --- target network updates ------------------------------------------------------------------------
def _one_step_batch():
    return transitions(obs=[0], action=[0], reward=[1.0], next_obs=[1], terminated=[False], truncated=[False])


def test_hard_target_update_copies_online_net_every_target_update_freq_steps():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]], target_update_freq=2)
    start = policy.target_model.table.detach().clone()
    policy.learn_mode.forward(_one_step_batch())
    assert torch.equal(policy.target_model.table, start)
    assert not torch.equal(policy.model.table, start)
    policy.learn_mode.forward(_one_step_batch())
    assert policy.learn_mode.train_iter == 2
    assert torch.equal(policy.target_model.table, policy.model.table)


def test_soft_target_update_moves_target_by_theta_each_step():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]], target_theta=0.25)
    before = policy.target_model.table.detach().clone()
    policy.learn_mode.forward(_one_step_batch())
    expected = 0.75 * before + 0.25 * policy.model.table.detach()
    torch.testing.assert_close(policy.target_model.table, expected)
    assert not torch.equal(policy.target_model.table, policy.model.table)


def test_target_network_gets_no_gradients():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]])
    policy.learn_mode.forward(_one_step_batch())
    assert all(p.grad is None and not p.requires_grad for p in policy.target_model.parameters())


# --- prioritized replay --------------------------------------------------------------------------
def _twin_policies():
    return [table_policy([[0.0, 0.0], [1.0, 3.0]]) for _ in range(2)]


def _batch_with_weight(weight):
    return transitions(obs=[0, 0], action=[0, 1], reward=[1.0, 2.0], next_obs=[1, 1],
                       terminated=[True, True], truncated=[False, False], weight=weight)


def test_importance_weights_scale_the_loss():
    unit, doubled = _twin_policies()
    loss_unit = unit.learn_mode.forward(_batch_with_weight([1.0, 1.0]))["losses/td"]
    loss_doubled = doubled.learn_mode.forward(_batch_with_weight([2.0, 2.0]))["losses/td"]
    assert loss_doubled == pytest.approx(2.0 * loss_unit)


def test_zero_importance_weight_leaves_its_sample_out_of_the_update():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]])
    policy.learn_mode.forward(_batch_with_weight([1.0, 0.0]))
    q = policy.model.table.detach()
    assert q[0, 0] != 0.0  # the weighted sample (action 0) moved
    assert q[0, 1] == 0.0  # the zero-weight sample (action 1) did not


def test_priority_is_absolute_td_error_per_sample():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]])
    with torch.no_grad():
        policy.model.table[0] = torch.tensor([4.0, -1.0])
    out = policy.learn_mode.forward(_batch_with_weight([1.0, 1.0]))
    assert isinstance(out.priorities, np.ndarray) and out.priorities.shape == (2,)
    np.testing.assert_allclose(out.priorities, [abs(4.0 - 1.0), abs(-1.0 - 2.0)], rtol=1e-6)


def test_no_priority_without_importance_weights():
    policy = table_policy([[0.0, 0.0], [1.0, 3.0]])
    assert policy.learn_mode.forward(_one_step_batch()).priorities is None


# --- acting ----------------------------------------------------------------------------------------
def _greedy_zero_policy(seed: int = 0) -> DQNPolicy:
    """Four actions, action 0 always best."""
    return DQNPolicy({}, model=TableQ([[1.0, 0.0, 0.0, 0.0]]), seed=seed)


def test_eps_greedy_explores_at_rate_eps_with_uniform_random_actions():
    policy, eps, n_env, calls = _greedy_zero_policy(), 0.3, 8, 2000
    obs = np.zeros(n_env, dtype=np.int64)
    actions = np.concatenate([policy.collect_mode.forward(obs, eps=eps)["action"] for _ in range(calls)])
    counts = np.bincount(actions, minlength=4) / actions.size
    expected = np.array([1 - eps + eps / 4] + [eps / 4] * 3)
    sigma = np.sqrt(expected * (1 - expected) / actions.size)
    assert np.all(np.abs(counts - expected) < 5 * sigma), counts


def test_eps_greedy_draws_independently_per_env():
    policy = _greedy_zero_policy()
    action = policy.collect_mode.forward(np.zeros(1000, dtype=np.int64), eps=0.5)["action"]
    assert action.shape == (1000,) and 0 < np.count_nonzero(action) < 1000


def test_eps_greedy_is_reproducible_from_the_seed():
    obs = np.zeros(16, dtype=np.int64)
    runs = [[twin.collect_mode.forward(obs, eps=0.5)["action"] for _ in range(5)]
            for twin in (_greedy_zero_policy(seed=7), _greedy_zero_policy(seed=7))]
    np.testing.assert_array_equal(np.stack(runs[0]), np.stack(runs[1]))


def test_exploration_without_a_seed_follows_torch_manual_seed():
    obs = np.zeros(64, dtype=np.int64)
    actions = []
    for _ in range(2):
        torch.manual_seed(3)
        policy = DQNPolicy({}, model=TableQ([[1.0, 0.0, 0.0, 0.0]]))
        actions.append(policy.collect_mode.forward(obs, eps=0.5)["action"])
    np.testing.assert_array_equal(actions[0], actions[1])


def test_eps_zero_collects_greedily():
    policy = _greedy_zero_policy()
    action = policy.collect_mode.forward(np.zeros(64, dtype=np.int64), eps=0.0)["action"]
    assert action.dtype == np.int64 and not action.any()


def test_eps_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="eps must be in"):
        _greedy_zero_policy().collect_mode.forward(np.zeros(2, dtype=np.int64), eps=1.5)


def test_eval_mode_acts_greedily():
    policy = DQNPolicy({}, model=TableQ([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0]]), seed=0)
    for _ in range(20):
        np.testing.assert_array_equal(policy.eval_mode.forward(np.array([0, 1, 2, 1]))["action"], [1, 0, 2, 0])



def test_eval_eps_explores_from_its_own_generator_and_resumes_exactly():
    policy = DQNPolicy({"eval": {"eps": 0.5}}, model=TableQ([[1.0, 0.0, 0.0, 0.0]]), seed=0)
    greedy_twin = _greedy_zero_policy(seed=0)
    obs = np.zeros(1000, dtype=np.int64)
    state = policy.state_dict()
    explored = policy.eval_mode.forward(obs)["action"]
    assert 300 < np.count_nonzero(explored) < 450  # 0.5 * 3/4 of the envs take another action than 0
    np.testing.assert_array_equal(policy.collect_mode.forward(obs, eps=0.5)["action"],  # collecting's draws
                                  greedy_twin.collect_mode.forward(obs, eps=0.5)["action"])  # are untouched
    policy.load_state_dict(state)
    np.testing.assert_array_equal(policy.eval_mode.forward(obs)["action"], explored)


# --- observations through built models -------------------------------------------------------------
def test_dict_observations_flow_through_collect_eval_and_learn():
    shapes = {"pos": 3, "image": [6, 6, 3]}
    policy = DQNPolicy({"model": {"obs_shape": shapes, "action_shape": 4, "hidden_sizes": [16]}}, seed=0)
    rng = np.random.default_rng(0)

    def obs(n):
        return {"pos": rng.normal(size=(n, 3)).astype(np.float32),
                "image": rng.integers(0, 256, size=(n, 6, 6, 3), dtype=np.uint8)}

    assert policy.collect_mode.forward(obs(5), eps=0.1)["action"].shape == (5,)
    assert policy.eval_mode.forward(obs(5))["action"].shape == (5,)
    batch = as_tree({"obs": obs(8), "next_obs": obs(8), "action": rng.integers(0, 4, size=8),
                     "reward": np.ones(8, np.float32), "terminated": np.zeros(8, bool), "truncated": np.zeros(8, bool)})
    assert np.isfinite(policy.learn_mode.forward(batch)["losses/td"])


def test_image_observations_use_the_conv_encoder():
    policy = DQNPolicy({"model": {"obs_shape": [3, 40, 40], "action_shape": 5, "hidden_sizes": [32]}}, seed=0)
    assert any(isinstance(m, torch.nn.Conv2d) for m in policy.model.modules())
    images = np.random.default_rng(0).integers(0, 256, size=(4, 3, 40, 40), dtype=np.uint8)
    assert policy.eval_mode.forward(images)["action"].shape == (4,)


# --- checkpoints -----------------------------------------------------------------------------------
def _cartpole_like_batch(seed: int) -> ttorch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return ttorch.Tensor({"obs": torch.randn(16, 4, generator=g), "next_obs": torch.randn(16, 4, generator=g),
                          "action": torch.randint(0, 2, (16,), generator=g), "reward": torch.randn(16, generator=g),
                          "terminated": torch.rand(16, generator=g) < 0.2,
                          "truncated": torch.zeros(16, dtype=torch.bool)})


def test_state_dict_round_trip_restores_model_target_optimizer_counters_and_rng():
    cfg = {"model": {"obs_shape": 4, "action_shape": 2}, "learn": {"target_update_freq": 1000}}
    trained = DQNPolicy(cfg, seed=1)
    for i in range(5):
        trained.learn_mode.forward(_cartpole_like_batch(i))
    trained.collect_mode.forward(np.zeros((3, 4), np.float32), eps=0.5)
    resumed = DQNPolicy(cfg, seed=2)
    resumed.load_state_dict(through_bytes(trained.state_dict()))

    assert resumed.learn_mode.train_iter == 5
    for a, b in [(trained.model, resumed.model), (trained.target_model, resumed.target_model)]:
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), name
    assert not torch.equal(next(trained.model.parameters()), next(trained.target_model.parameters()))
    # Same next step: the optimizer moments and the exploration RNG came back too.
    out_a, out_b = (p.learn_mode.forward(_cartpole_like_batch(99)) for p in (trained, resumed))
    assert out_a == out_b
    for x, y in zip(trained.model.parameters(), resumed.model.parameters()):
        assert torch.equal(x, y)
    obs = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    np.testing.assert_array_equal(trained.collect_mode.forward(obs, eps=0.5)["action"],
                                  resumed.collect_mode.forward(obs, eps=0.5)["action"])


# --- learning --------------------------------------------------------------------------------------
def test_dqn_learns_a_two_state_contextual_bandit():
    """Reward 1 for the action matching the state (one-hot), 0 otherwise; episodes end at once."""
    torch.manual_seed(0)
    policy = DQNPolicy({"model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [16]},
                        "learn": {"learning_rate": 0.01}}, seed=0)
    rng = np.random.default_rng(0)
    eye = np.eye(2, dtype=np.float32)
    for _ in range(200):
        state = rng.integers(0, 2, size=32)
        action = rng.integers(0, 2, size=32)
        policy.learn_mode.forward({"obs": eye[state], "next_obs": eye[state], "action": action,
                                   "reward": (action == state).astype(np.float32),
                                   "terminated": np.ones(32, bool), "truncated": np.zeros(32, bool)})
    policy.learn_mode.publish()
    np.testing.assert_array_equal(policy.eval_mode.forward(eye)["action"], [0, 1])
    assert policy.learn_mode.train_iter == 200


# --- config ----------------------------------------------------------------------------------------
def test_default_config_is_the_schema_defaults_and_builds_with_shapes():
    cfg = DQNPolicy.default_config()
    assert cfg.learn.double is True and cfg.learn.loss == "huber" and cfg.nstep == 1
    assert cfg.other.replay_buffer.size > 0 and cfg.other.eps.kind == "exp"
    cfg.model.update(obs_shape=4, action_shape=2)
    assert DQNPolicy(cfg).collect_mode.forward(np.zeros((8, 4), np.float32), eps=0.1)["action"].shape == (8,)


def test_misspelt_config_key_is_an_error_naming_the_closest_key():
    with pytest.raises(ConfigError, match=r"policy\.learn\.batch_size"):
        DQNPolicy({"model": {"obs_shape": 4, "action_shape": 2}, "learn": {"batch_sise": 32}})


def test_bad_config_value_is_an_error():
    with pytest.raises(ConfigError, match=r"policy\.learn\.loss"):
        DQNPolicy({"model": {"obs_shape": 4, "action_shape": 2}, "learn": {"loss": "hubber"}})
    with pytest.raises(ConfigError, match=r"policy\.learn\.target_theta"):
        DQNPolicy({"model": {"obs_shape": 4, "action_shape": 2}, "learn": {"target_theta": 2.0}})


def test_missing_obs_shape_is_an_error_saying_how_to_set_it():
    with pytest.raises(ConfigError, match=r"policy\.model\.obs_shape.*not set"):
        DQNPolicy({"model": {"action_shape": 2}})


def test_an_update_with_a_loss_that_is_not_finite_is_skipped_and_counted_so_weights_never_become_nan():
    cfg = {"model": {"obs_shape": 4, "action_shape": 2}, "learn": {"target_update_freq": 1000}}
    policy = DQNPolicy(cfg, seed=0)
    policy.learn_mode.forward(_cartpole_like_batch(0))  # the optimizer has state to keep
    before = copy.deepcopy(policy.state_dict())
    poisoned = _cartpole_like_batch(1)
    poisoned.reward[3] = float("nan")
    out = policy.learn_mode.forward(poisoned)
    after = policy.state_dict()
    assert out["charts/skipped_updates"] == 1.0 and policy.finite_steps.skipped == 1
    for name, tensor in before["model"].items():
        assert torch.equal(after["model"][name], tensor), name
    for index, state in before["optimizer"]["state"].items():
        assert all(torch.equal(after["optimizer"]["state"][index][key], value) for key, value in state.items())
    policy.learn_mode.forward(_cartpole_like_batch(2))  # good data still trains
    assert all(torch.isfinite(t).all() for t in policy.state_dict()["model"].values())
    assert not torch.equal(policy.state_dict()["model"][next(iter(before["model"]))], before["model"][
        next(iter(before["model"]))])
