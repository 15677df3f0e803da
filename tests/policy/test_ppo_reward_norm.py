"""Reward normalisation (PPO's model.reward_norm): returns per env, when statistics move, checkpoints, the wire."""
import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor.middleware import gae_estimator
from conveyor.engine import OnlineRLContext
from conveyor.policy import PPOPolicy, RewardNormaliser
from conveyor.policy.normaliser import FrozenNormaliser

GAMMA = 0.9


def test_returns_are_discounted_per_env_and_restart_after_an_episode_end():
    norm = RewardNormaliser(GAMMA, clip=None)
    reward = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    done = np.array([[False, True], [False, False], [False, False]])
    norm.observe(reward[:2], done[:2])
    norm.observe(reward[2:], done[2:])  # the returns go on from one chunk to the next
    returns = [1.0, 2.0, 1.9, 2.0, 2.71, 3.8]
    assert norm.commit()
    assert norm.stats.count == 6
    np.testing.assert_allclose(norm.stats.var, np.var(returns))
    np.testing.assert_allclose(norm.scale(), 1.0 / np.sqrt(np.var(returns) + 1e-8))
    np.testing.assert_allclose(norm.returns, [2.71, 3.8])


def test_invalid_steps_take_no_part_in_the_statistics():
    norm = RewardNormaliser(GAMMA)
    norm.observe(np.array([[1.0], [5.0]]), np.array([[False], [True]]), np.array([[True], [False]]))
    norm.commit()
    assert norm.stats.count == 1


def reward_norm_policy(**model):
    return PPOPolicy({"discount_factor": GAMMA, "model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [8],
                                                          "reward_norm": True, **model},
                      "learn": {"batch_size": 4}}, seed=0)


def learn_and_publish(policy):
    obs = np.zeros((4, 2), np.float32)
    out = policy.collect_mode.forward(obs)
    policy.learn_mode.forward(ttorch.Tensor({
        "obs": torch.from_numpy(obs), "action": torch.from_numpy(out["action"]), "logp": torch.from_numpy(out["logp"]),
        "value": torch.from_numpy(out["value"]), "adv": torch.ones(4), "return": torch.ones(4), "reward": torch.zeros(4)}))
    policy.learn_mode.publish()


def rollout(seed, steps=16, envs=2):
    rng = np.random.default_rng(seed)
    return rng.normal(3.0, 2.0, size=(steps, envs)).astype(np.float32), rng.random((steps, envs)) < 0.1


def test_rewards_are_scaled_by_statistics_folded_in_when_an_update_is_published():
    policy = reward_norm_policy(reward_norm_clip=100.0)
    reward, done = rollout(0)
    first = policy.collect_mode.scale_reward(reward, done)
    np.testing.assert_allclose(first, reward, rtol=1e-6)  # nothing folded in yet: (almost) the identity
    twice = policy.collect_mode.scale_reward(reward, done)
    np.testing.assert_allclose(twice, reward, rtol=1e-6)  # a rollout is scaled with one set of statistics
    learn_and_publish(policy)
    expected = RewardNormaliser(GAMMA, clip=None)
    expected.observe(reward, done)
    expected.observe(reward, done)
    expected.commit()
    np.testing.assert_allclose(policy.collect_mode.scale_reward(reward, done), reward * expected.scale(), rtol=1e-5)


def test_scaled_rewards_are_clipped():
    policy = reward_norm_policy(reward_norm_clip=0.5)
    reward, done = rollout(1)
    policy.collect_mode.scale_reward(reward, done)
    learn_and_publish(policy)
    assert np.abs(policy.collect_mode.scale_reward(reward * 100, done)).max() == pytest.approx(0.5)


def test_without_reward_norm_rewards_pass_unchanged():
    policy = PPOPolicy({"model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [8]}}, seed=0)
    reward, done = rollout(2)
    assert policy.collect_mode.scale_reward(reward, done) is reward
    assert "reward_normaliser" not in policy.state_dict()


def test_checkpoint_round_trip_restores_statistics_pending_returns_and_scale():
    policy = reward_norm_policy()
    reward, done = rollout(3)
    policy.collect_mode.scale_reward(reward, done)
    learn_and_publish(policy)
    policy.collect_mode.scale_reward(reward * 2, done)  # gathered, not yet folded in
    restored = reward_norm_policy()
    restored.load_state_dict(policy.state_dict())
    mine, theirs = restored.reward_normaliser, policy.reward_normaliser
    assert mine.stats.count == theirs.stats.count > 0 and mine.pending.count == theirs.pending.count > 0
    np.testing.assert_array_equal(mine.returns, theirs.returns)
    np.testing.assert_array_equal(restored.collect_mode.scale_reward(reward, done),
                                  policy.collect_mode.scale_reward(reward, done))


def test_the_published_scale_crosses_the_codec_to_a_replica():
    from conveyor.engine.parallel import codec
    from conveyor.policy.weights import WIRE_TYPES
    for wire_type in WIRE_TYPES:
        codec.register(*wire_type)
    learner, replica = reward_norm_policy(obs_norm=True), reward_norm_policy(obs_norm=True)
    reward, done = rollout(4)
    learner.collect_mode.scale_reward(reward, done)
    learner.collect_mode.forward(np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32))
    learn_and_publish(learner)
    state = codec.decode([bytes(f) for f in codec.encode(learner.acting_state())])
    assert isinstance(state["extras"], FrozenNormaliser)
    replica.load_acting_state(state)
    np.testing.assert_array_equal(replica.collect_mode.scale_reward(reward, done),
                                  learner.collect_mode.scale_reward(reward, done))
    obs = np.array([[0.5, -2.0]], np.float32)
    np.testing.assert_array_equal(replica.collect_mode.value(obs), learner.collect_mode.value(obs))


def test_gae_estimates_advantages_from_scaled_rewards_and_keeps_the_raw_reward():
    policy = reward_norm_policy()
    reward, done = rollout(5, steps=8)
    policy.collect_mode.scale_reward(reward, done)
    learn_and_publish(policy)
    scale = policy.reward_normaliser.scale()
    cfg = EasyDict(policy=dict(discount_factor=GAMMA, gae_lambda=1.0, learn={}))
    traj = ttorch.Tensor({"obs": torch.zeros(8, 2, 2), "next_obs": torch.zeros(8, 2, 2),
                          "reward": torch.from_numpy(reward), "value": torch.zeros(8, 2),
                          "terminated": torch.ones(8, 2, dtype=torch.bool), "truncated": torch.zeros(8, 2, dtype=torch.bool)})
    ctx = OnlineRLContext()
    ctx.trajectories = traj
    gae_estimator(cfg, policy.collect_mode)(ctx)
    data = ctx.train_data
    np.testing.assert_allclose(data.adv.numpy(), reward.reshape(-1) * scale, rtol=1e-5)  # every step terminates
    np.testing.assert_array_equal(data.reward.numpy(), reward.reshape(-1))
