"""offline_data_fetcher: epochs of shuffled minibatches shaped like replay samples, resumed exactly."""
import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch
from easydict import EasyDict

from conveyor import OfflineRLContext, task
from conveyor.data import DatasetError, DequeBuffer, OfflineDataset
from conveyor.middleware import offline_data_fetcher

OBS = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
ACT = gym.spaces.Discrete(2)


def dataset(n=23, seed=0):
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(n + 1, 4)).astype(np.float32)
    ends = np.zeros(n, bool)
    ends[[6, 15, n - 1]] = True
    return OfflineDataset(observations=obs[:-1], actions=rng.integers(0, 2, n), rewards=np.ones(n),
                          next_observations=obs[1:], terminations=ends, truncations=np.zeros(n, bool),
                          observation_space=OBS, action_space=ACT)


def config(batch_size=5, seed=0):
    return EasyDict(seed=seed, policy=dict(learn=dict(batch_size=batch_size)))


def run(fetcher, steps, state=None):
    """``steps`` iterations of a pipeline holding only the fetcher; the batches' indices and the final context."""
    seen = []
    with task.start(ctx=OfflineRLContext()):
        task.use(fetcher)
        task.use(lambda ctx: seen.append((ctx.train_data.index.clone(), ctx.train_epoch)))
        if state is not None:
            task.load_state_dict(state)
        task.run(max_step=steps)
        return seen, task.state_dict()


def test_each_epoch_hands_out_every_row_once_then_advances_train_epoch():
    seen, _ = run(offline_data_fetcher(config(batch_size=5), dataset(23)), steps=10)
    sizes = [len(index) for index, _ in seen]
    assert sizes == [5, 5, 5, 5, 3] * 2  # the remainder closes each epoch
    for epoch in range(2):
        rows = torch.cat([index for index, _ in seen[epoch * 5:(epoch + 1) * 5]])
        assert sorted(rows.tolist()) == list(range(23))
    assert [e for _, e in seen] == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2]
    first, second = (torch.cat([i for i, _ in seen[k:k + 5]]) for k in (0, 5))
    assert not torch.equal(first, second)  # a new permutation per epoch


def test_batches_have_the_fields_and_dtypes_of_a_replay_sample():
    data = dataset()
    batch = offline_data_fetcher(config(), data).next_batch()
    buffer = DequeBuffer(100, seed=0)
    buffer.extend({key: value for key, value in data.as_batch().items()})
    sample = buffer.sample(5)
    assert sorted(batch.keys()) == sorted(sample.keys())
    assert all(batch[key].dtype == sample[key].dtype and batch[key].shape == sample[key].shape for key in sample.keys())
    rows = batch.index.numpy()
    assert np.array_equal(batch.obs.numpy(), data.observations[rows])
    assert np.array_equal(batch.next_obs.numpy(), data.next_observations[rows])
    assert np.array_equal(batch.terminated.numpy(), data.terminations[rows])


def test_resume_from_a_checkpoint_hands_out_the_same_batches():
    data = dataset()
    uninterrupted, _ = run(offline_data_fetcher(config(seed=3), data), steps=12)
    first, state = run(offline_data_fetcher(config(seed=3), data), steps=7)
    rest, _ = run(offline_data_fetcher(config(seed=3), data), steps=5, state=pickle.loads(pickle.dumps(state)))
    assert [(i.tolist(), e) for i, e in first + rest] == [(i.tolist(), e) for i, e in uninterrupted]


def test_state_of_another_dataset_is_refused():
    state = offline_data_fetcher(config(), dataset(23)).state_dict()
    with pytest.raises(DatasetError, match="dataset of 23 transitions, this one .* has 30"):
        offline_data_fetcher(config(), dataset(30)).load_state_dict(state)


def test_dataset_of_other_spaces_than_the_policy_env_is_refused():
    with pytest.raises(DatasetError, match=r"observation space Box.*\(4,\).* has Box.*\(3,\)"):
        offline_data_fetcher(config(), dataset(), observation_space=gym.spaces.Box(-1, 1, (3,), np.float32),
                             action_space=ACT)


def test_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match="batch_size must be an int > 0, got 0"):
        offline_data_fetcher(config(batch_size=0), dataset())


def test_a_dqn_learner_trains_on_the_batches_unchanged():
    from conveyor.config import compile_config
    from conveyor.middleware import trainer
    from conveyor.policy import DQNPolicy
    cfg = compile_config(EasyDict(dict(exp_name="offline", seed=0, env=dict(env_id="CartPole-v1"),
                                       policy=dict(nstep=1, learn=dict(batch_size=8, update_per_collect=1),
                                                   model=dict(hidden_sizes=[16])))), policy=DQNPolicy)
    policy = DQNPolicy(cfg.policy, seed=0)
    with task.start(ctx=OfflineRLContext()):
        task.use(offline_data_fetcher(cfg, dataset(), observation_space=OBS, action_space=ACT))
        task.use(trainer(cfg, policy.learn_mode))
        losses = []
        task.use(lambda ctx: losses.append(ctx.train_output[0]["losses/td"]))
        task.run(max_step=4)
        assert task.ctx.train_iter == 4 and np.isfinite(losses).all()


def test_a_sac_learner_trains_on_continuous_batches_unchanged():
    from conveyor.config import compile_config
    from conveyor.middleware import trainer
    from conveyor.policy import SACPolicy
    cfg = compile_config(EasyDict(dict(exp_name="offline", seed=0, env=dict(env_id="Pendulum-v1"),
                                       policy=dict(learn=dict(batch_size=8, update_per_collect=1),
                                                   model=dict(hidden_sizes=[16, 16])))), policy=SACPolicy)
    env = gym.make("Pendulum-v1")
    rng = np.random.default_rng(0)
    obs = rng.uniform(-1, 1, (21, 3)).astype(np.float32)
    data = OfflineDataset(observations=obs[:-1], actions=rng.uniform(-2, 2, (20, 1)).astype(np.float32),
                          rewards=-rng.random(20), next_observations=obs[1:], terminations=np.zeros(20, bool),
                          truncations=np.arange(20) == 19, observation_space=env.observation_space,
                          action_space=env.action_space)
    policy = SACPolicy(cfg.policy, seed=0)
    with task.start(ctx=OfflineRLContext()):
        task.use(offline_data_fetcher(cfg, data, observation_space=env.observation_space,
                                      action_space=env.action_space))
        task.use(trainer(cfg, policy.learn_mode))
        task.run(max_step=3)
        assert task.ctx.train_iter == 3


def test_returns_range_scales_rewards_by_1000_over_the_spread_of_episode_returns():
    cfg = config(batch_size=23)
    cfg.policy.other = dict(dataset=dict(reward_scale="returns_range"))
    fetcher = offline_data_fetcher(cfg, dataset(23))  # episodes of 7, 9 and 7 unit rewards: a spread of 2
    assert fetcher.reward_scale == 500.0
    assert torch.equal(fetcher.next_batch().reward, torch.full((23,), 500.0))
    assert offline_data_fetcher(config(batch_size=23), dataset(23)).next_batch().reward.eq(1.0).all()


def test_returns_range_on_episodes_of_one_return_is_an_error_naming_the_fix():
    obs = np.zeros((17, 4), np.float32)
    ends = np.zeros(16, bool)
    ends[[7, 15]] = True  # two episodes of 8 unit rewards
    equal = OfflineDataset(observations=obs[:-1], actions=np.zeros(16, np.int64), rewards=np.ones(16),
                           next_observations=obs[1:], terminations=ends, truncations=np.zeros(16, bool),
                           observation_space=OBS, action_space=ACT)
    cfg = config()
    cfg.policy.other = dict(dataset=dict(reward_scale="returns_range"))
    with pytest.raises(DatasetError, match="every episode .* returns 8: set policy.other.dataset.reward_scale='none'"):
        offline_data_fetcher(cfg, equal)
