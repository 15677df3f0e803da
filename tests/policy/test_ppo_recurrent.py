"""Recurrent PPO: per-env state reset at episode ends through the collector, stored with each step, and
replayed from the stored state when learning from sequences."""
import gymnasium as gym
import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor import OnlineRLContext
from conveyor.envs import SyncEnvManager
from conveyor.middleware import StepCollector, gae_estimator
from conveyor.policy import PPOPolicy

HIDDEN = 4


class FixedLength(gym.Env):
    """Episodes of exactly ``length`` steps; the observation is (step / 10, length / 10)."""

    observation_space = gym.spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, length):
        self.length, self.t = length, 0

    def _obs(self):
        return np.array([self.t / 10, self.length / 10], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), float(action), self.t >= self.length, False, {}


@pytest.fixture
def envs(request):
    env = SyncEnvManager([lambda: FixedLength(3), lambda: FixedLength(5)], seed=0)
    request.addfinalizer(env.close)
    return env


def recurrent_policy(**learn):
    return PPOPolicy({"model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [8], "rnn": "gru",
                                "rnn_hidden_size": HIDDEN},
                      "learn": {"sequence_length": 4, **learn}}, seed=0)


def collect(policy, env, steps=12):
    cfg = EasyDict(seed=0, policy=dict(collect=dict(n_sample=steps * env.env_num)))
    ctx = OnlineRLContext()
    StepCollector(cfg, policy.collect_mode, env)(ctx)
    return ctx


def test_the_collector_stores_the_state_before_each_step_and_resets_it_at_episode_ends(envs):
    traj = collect(recurrent_policy(), envs).trajectories
    hidden, next_hidden = traj.hidden.numpy(), traj.next_hidden.numpy()
    done = (traj.terminated | traj.truncated).numpy()
    assert hidden.shape == next_hidden.shape == (12, 2, HIDDEN)
    assert done[:, 0].sum() == 4 and done[:, 1].sum() == 2  # episodes of 3 and 5 steps
    for t in range(12):
        for env in range(2):
            if t == 0 or done[t - 1, env]:  # a new episode starts from a zero state
                assert not hidden[t, env].any()
            else:  # otherwise from the state the previous step left
                assert hidden[t, env].any()
                np.testing.assert_array_equal(hidden[t, env], next_hidden[t - 1, env])


def test_reset_clears_only_the_named_envs():
    policy = recurrent_policy()
    obs = np.ones((3, 2), np.float32)
    policy.collect_mode.forward(obs)
    policy.collect_mode.reset([1])
    hidden = policy.collect_mode.forward(obs)["hidden"]
    assert hidden[0].any() and not hidden[1].any() and hidden[2].any()


def test_bootstrap_values_read_the_state_after_the_step(envs):
    policy = recurrent_policy()
    traj = collect(policy, envs).trajectories
    done = (traj.terminated | traj.truncated).numpy()
    values = policy.collect_mode.value(traj.next_obs[:-1].flatten(0, 1), hidden=traj.next_hidden[:-1].flatten(0, 1))
    values = values.reshape(11, 2)
    kept = ~done[:-1]
    np.testing.assert_allclose(values[kept], traj.value.numpy()[1:][kept], rtol=1e-5, atol=1e-6)


def test_learning_replays_sequences_from_the_stored_states(envs):
    policy = recurrent_policy()
    cfg = EasyDict(policy=dict(discount_factor=0.99, gae_lambda=0.95, learn=dict(sequence_length=4)))
    ctx = collect(policy, envs)
    gae_estimator(cfg, policy.collect_mode)(ctx)
    data = ctx.train_data
    assert tuple(data.obs.shape[:2]) == (4, 6)  # 12 steps of 2 envs in sequences of 4
    assert data.hidden[0].abs().sum(-1).gt(0).any()  # some sequences start mid-episode, from a non-zero state
    assert data.episode_start[1:].any()  # and some episodes start inside a sequence
    out = policy.learn_mode.forward(data)
    # Before any update the replay reproduces the collected log-probabilities exactly, which needs both the
    # stored initial states and the resets at episode starts.
    assert out["charts/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert out["charts/clip_frac"] == 0.0


def test_replaying_without_the_episode_resets_would_not_reproduce_the_collected_actions(envs):
    policy = recurrent_policy()
    cfg = EasyDict(policy=dict(discount_factor=0.99, gae_lambda=0.95, learn=dict(sequence_length=4)))
    ctx = collect(policy, envs)
    gae_estimator(cfg, policy.collect_mode)(ctx)
    data = ctx.train_data
    with torch.no_grad():
        right, _ = policy.model.unroll(data.obs, data.hidden[0], data.episode_start)
        wrong, _ = policy.model.unroll(data.obs, data.hidden[0], torch.zeros_like(data.episode_start))
    assert torch.allclose(right.log_softmax(-1).gather(-1, data.action.long().unsqueeze(-1)).squeeze(-1), data.logp,
                          atol=1e-5)
    assert not torch.allclose(right, wrong)


def test_a_recurrent_policy_refuses_flat_batches():
    policy = recurrent_policy()
    flat = ttorch.Tensor({"obs": torch.zeros(4, 2), "action": torch.zeros(4, dtype=torch.long), "logp": torch.zeros(4),
                          "value": torch.zeros(4), "adv": torch.zeros(4), "return": torch.zeros(4),
                          "reward": torch.zeros(4)})
    with pytest.raises(ValueError, match="sequences"):
        policy.learn_mode.forward(flat)
