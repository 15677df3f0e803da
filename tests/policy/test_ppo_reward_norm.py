"""Reward normalisation (PPO's model.reward_norm): returns per env, where statistics are kept and when they move,
checkpoints, and a collector that is a replica of the learner elsewhere."""
import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.middleware import gae_estimator, multistep_trainer
from conveyor.policy import PPOPolicy, RewardNormaliser
from conveyor.policy.normaliser import FrozenNormaliser

GAMMA = 0.9
STEPS, ENVS = 16, 2


def test_returns_are_discounted_per_env_and_restart_after_an_episode_end():
    norm = RewardNormaliser(GAMMA, clip=None)
    reward = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    done = np.array([[False, True], [False, False], [False, False]])
    first = norm.discount(reward[:2], done[:2])
    second = norm.discount(reward[2:], done[2:])  # the returns go on from one chunk to the next
    returns = np.concatenate([first, second])
    np.testing.assert_allclose(returns, [[1.0, 2.0], [1.9, 2.0], [2.71, 3.8]], rtol=1e-6)
    norm.gather(returns)
    assert norm.commit() and not norm.commit()
    assert norm.stats.count == 6
    np.testing.assert_allclose(norm.stats.var, np.var(returns), rtol=1e-6)
    np.testing.assert_allclose(norm.scale(), 1.0 / np.sqrt(np.var(returns) + 1e-8), rtol=1e-6)


def reward_norm_policy(**model):
    return PPOPolicy({"discount_factor": GAMMA, "gae_lambda": 1.0,
                      "model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [8], "reward_norm": True, **model},
                      "learn": {"batch_size": STEPS * ENVS, "epoch_per_collect": 1}}, seed=0)


def rollout(seed):
    """A time-major trajectory [T, N] as StepCollector leaves it (values and log-probs of a fixed policy)."""
    rng = np.random.default_rng(seed)
    shape = (STEPS, ENVS)
    return ttorch.Tensor({
        "obs": torch.zeros(*shape, 2), "next_obs": torch.zeros(*shape, 2), "action": torch.zeros(shape, dtype=torch.long),
        "logp": torch.full(shape, -float(np.log(2))), "value": torch.zeros(shape),
        "reward": torch.from_numpy(rng.normal(3.0, 2.0, size=shape).astype(np.float32)),
        "terminated": torch.from_numpy(rng.random(shape) < 0.1), "truncated": torch.zeros(shape, dtype=torch.bool)})


def cfg_of(policy):
    return EasyDict(seed=0, policy=policy.cfg)


def estimate(collector, traj):
    ctx = OnlineRLContext()
    ctx.trajectories = traj
    gae_estimator(cfg_of(collector), collector.collect_mode)(ctx)
    return ctx


def train(learner, ctx):
    multistep_trainer(cfg_of(learner), learner.learn_mode)(ctx)  # gathers the round's returns, steps, publishes


def expected_scale(*trajectories):
    norm = RewardNormaliser(GAMMA, clip=None)
    for traj in trajectories:
        done = (traj.terminated | traj.truncated).numpy()
        norm.gather(norm.discount(traj.reward.numpy(), done))
    norm.commit()
    return norm.scale()


def test_rewards_are_scaled_by_the_returns_of_earlier_rollouts_folded_in_when_an_update_is_published():
    policy = reward_norm_policy(reward_norm_clip=100.0)
    first, second = rollout(0), rollout(1)
    ctx = estimate(policy, first)
    assert ctx.train_data.discounted_return.shape == (STEPS * ENVS,)
    scaled, _ = policy.collect_mode.scale_reward(first.reward.numpy(), first.terminated.numpy())
    np.testing.assert_allclose(scaled, first.reward.numpy(), rtol=1e-6)  # nothing folded in yet: the identity
    train(policy, ctx)
    scaled, _ = policy.collect_mode.scale_reward(second.reward.numpy(), second.terminated.numpy())
    np.testing.assert_allclose(scaled, second.reward.numpy() * expected_scale(first), rtol=1e-5)


def test_scaled_rewards_are_clipped():
    policy = reward_norm_policy(reward_norm_clip=0.5)
    train(policy, estimate(policy, rollout(2)))
    traj = rollout(3)
    scaled, _ = policy.collect_mode.scale_reward(traj.reward.numpy() * 100, traj.terminated.numpy())
    assert np.abs(scaled).max() == pytest.approx(0.5)


def test_without_reward_norm_rewards_pass_unchanged_and_nothing_is_gathered():
    policy = PPOPolicy({"model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [8]}}, seed=0)
    traj = rollout(4)
    reward = traj.reward.numpy()
    assert policy.collect_mode.scale_reward(reward, traj.terminated.numpy()) == (reward, None)
    assert "discounted_return" not in estimate(policy, traj).train_data
    assert "reward_normaliser" not in policy.state_dict()


def test_gae_estimates_advantages_from_scaled_rewards_and_keeps_the_raw_reward():
    policy = reward_norm_policy()
    first = rollout(5)
    train(policy, estimate(policy, first))
    traj = rollout(6)
    traj.terminated[:] = True  # every step ends its episode: the advantage is the (scaled) reward
    data = estimate(policy, traj).train_data
    scale = policy.reward_normaliser.scale()
    np.testing.assert_allclose(data.adv.numpy(), traj.reward.numpy().reshape(-1) * scale, rtol=1e-5)
    np.testing.assert_array_equal(data.reward.numpy(), traj.reward.numpy().reshape(-1))


def test_a_replica_collecting_elsewhere_feeds_the_learners_statistics_and_acts_with_its_scale():
    from conveyor.engine.parallel import codec
    from conveyor.policy.weights import WIRE_TYPES
    for wire_type in WIRE_TYPES:
        codec.register(*wire_type)
    learner, replica = reward_norm_policy(obs_norm=True), reward_norm_policy(obs_norm=True)
    first, second = rollout(7), rollout(8)
    train(learner, estimate(replica, first))  # the batch crosses to the learner; the replica keeps no statistics
    assert learner.reward_normaliser.stats.count == STEPS * ENVS
    state = codec.decode([bytes(f) for f in codec.encode(learner.acting_state())])  # as a collector process gets it
    assert isinstance(state["extras"], FrozenNormaliser)
    replica.load_acting_state(state)
    done = second.terminated.numpy()
    np.testing.assert_array_equal(replica.collect_mode.scale_reward(second.reward.numpy(), done)[0],
                                  learner.collect_mode.scale_reward(second.reward.numpy(), done)[0])
    np.testing.assert_allclose(replica.collect_mode.scale_reward(second.reward.numpy(), done)[0],
                               second.reward.numpy() * expected_scale(first), rtol=1e-5)


def test_checkpoint_round_trip_restores_statistics_pending_returns_and_scale():
    policy = reward_norm_policy()
    train(policy, estimate(policy, rollout(9)))
    ctx = estimate(policy, rollout(10))
    policy.learn_mode.gather(ctx.train_data)  # gathered, not yet folded in
    restored = reward_norm_policy()
    restored.load_state_dict(policy.state_dict())
    mine, theirs = restored.reward_normaliser, policy.reward_normaliser
    assert mine.stats.count == theirs.stats.count > 0 and mine.pending.count == theirs.pending.count > 0
    np.testing.assert_array_equal(mine.returns, theirs.returns)
    traj = rollout(11)
    reward, done = traj.reward.numpy(), traj.terminated.numpy()
    for a, b in zip(restored.collect_mode.scale_reward(reward, done), policy.collect_mode.scale_reward(reward, done)):
        np.testing.assert_array_equal(a, b)


def test_recurrent_sequences_gather_only_their_real_steps():
    policy = reward_norm_policy(rnn="gru", rnn_hidden_size=4)
    policy.cfg.learn.sequence_length = 5  # 16 steps: 4 sequences per env, the last padded with 4 steps
    traj = rollout(12)
    out = policy.collect_mode.forward(np.zeros((ENVS, 2), np.float32))
    hidden = torch.from_numpy(np.broadcast_to(out["hidden"], (STEPS, *out["hidden"].shape)).copy())
    traj = ttorch.Tensor({**{k: traj[k] for k in traj.keys()}, "hidden": hidden, "next_hidden": hidden})
    ctx = estimate(policy, traj)
    policy.learn_mode.gather(ctx.train_data)
    assert policy.reward_normaliser.pending.count == STEPS * ENVS
