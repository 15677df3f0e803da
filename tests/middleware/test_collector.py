"""Collectors: batched time-major trajectories, counters, crash handling, exploration schedule."""
import math

import numpy as np
import pytest

from conveyor import OnlineRLContext, task
from conveyor.envs import SyncEnvManager
from conveyor.middleware import EPISODE_EVENT, EpisodeCollector, StepCollector, eps_greedy_handler

from .conftest import CrashEveryK


def run_once(mw, ctx):
    with task.start(ctx=ctx):
        task.use(mw)
        task.run(max_step=1)
        return task.ctx


def test_step_collector_writes_a_time_major_batch_and_counts_env_steps(cfg, policy, cartpole_envs):
    env = cartpole_envs(4)
    collector = StepCollector(cfg, policy.collect_mode, env)
    ctx = OnlineRLContext()
    ctx.collect_kwargs = {"eps": 0.5}
    collector(ctx)
    traj = ctx.trajectories
    assert tuple(traj.obs.shape) == (4, 4, 4)  # [T = 16 / 4, N = 4, obs dim 4]
    assert tuple(traj.reward.shape) == (4, 4) and traj.terminated.dtype == traj.truncated.dtype
    assert ctx.env_step == 16
    assert bool(traj.valid.all())


def test_step_collector_continues_episodes_across_calls(cfg, policy, cartpole_envs):
    env = cartpole_envs(4)
    collector = StepCollector(cfg, policy.collect_mode, env)
    ctx = OnlineRLContext()
    ctx.collect_kwargs = {"eps": 0.0}
    collector(ctx)
    last_next_obs = ctx.trajectories.next_obs[-1].numpy()
    done = (ctx.trajectories.terminated[-1] | ctx.trajectories.truncated[-1]).numpy()
    collector(ctx)
    first_obs = ctx.trajectories.obs[0].numpy()
    assert np.allclose(first_obs[~done], last_next_obs[~done])
    assert ctx.env_step == 32


def test_step_collector_counts_episodes_and_emits_their_returns(cfg, policy, cartpole_envs):
    env = cartpole_envs(4)
    cfg.policy.collect.n_sample = 400
    episodes = []
    with task.start(ctx=OnlineRLContext()):
        task.on(EPISODE_EVENT, lambda i, ret, length: episodes.append((ret, length)))
        task.use(lambda ctx: ctx.collect_kwargs.update(eps=1.0))
        task.use(StepCollector(cfg, policy.collect_mode, env))
        task.run(max_step=1)
        assert task.ctx.env_episode == len(episodes) > 0
    assert all(ret == length for ret, length in episodes)  # CartPole pays 1 per step


def test_random_collect_ignores_the_policy_until_enough_env_steps(cfg, cartpole_envs):
    class Refuses:
        def forward(self, obs, **kwargs):
            raise AssertionError("policy used during random collection")

        def reset(self, env_ids=None):
            pass

    collector = StepCollector(cfg, Refuses(), cartpole_envs(4), random_collect_size=32)
    ctx = OnlineRLContext()
    collector(ctx)
    collector(ctx)
    assert ctx.env_step == 32
    with pytest.raises(AssertionError, match="random collection"):
        collector(ctx)


def test_a_crashed_env_step_is_marked_invalid_and_cuts_the_episode_before_it(cfg, policy):
    env = SyncEnvManager([lambda: CrashEveryK(k=3)] * 2, seed=0, max_retry=10)
    try:
        cfg.policy.collect.n_sample = 8  # 4 steps of 2 envs: step 3 of each env crashes
        ctx = OnlineRLContext()
        ctx.collect_kwargs = {"eps": 0.0}
        StepCollector(cfg, policy.collect_mode, env)(ctx)
        valid = ctx.trajectories.valid.numpy()
        assert valid[:, 0].tolist() == [True, True, False, True]
        assert ctx.trajectories.truncated[1].numpy().all()  # the step before the crash ends that episode
        assert ctx.env_step == 6
        assert env.stats.crashes == 2
    finally:
        env.close()


def test_episode_collector_returns_whole_episodes(cfg, policy, cartpole_envs):
    cfg.policy.collect.n_episode = 3
    ctx = OnlineRLContext()
    ctx.collect_kwargs = {"eps": 1.0}
    EpisodeCollector(cfg, policy.collect_mode, cartpole_envs(2))(ctx)
    assert len(ctx.episodes) == 3
    for episode in ctx.episodes:
        ends = (episode.terminated | episode.truncated).numpy()
        assert ends[-1] and not ends[:-1].any()
    lengths = [len(e.reward) for e in ctx.episodes]
    assert list(ctx.trajectory_end_idx) == list(np.cumsum(lengths) - 1)
    assert ctx.env_step >= sum(lengths) and ctx.env_episode == 3


def test_episode_collector_hands_episodes_that_end_together_to_the_next_call(cfg, policy):
    env = SyncEnvManager([lambda: CrashEveryK(k=10**9, episode_len=5)] * 2, seed=0)
    try:
        cfg.policy.collect.n_episode = 3
        collector = EpisodeCollector(cfg, policy.collect_mode, env)
        ctx = OnlineRLContext()
        ctx.collect_kwargs = {"eps": 1.0}
        collector(ctx)  # both envs end at steps 5 and 10: four episodes, three handed out
        assert len(ctx.episodes) == 3 and ctx.env_episode == 3 and ctx.env_step == 20
        collector(ctx)  # the fourth comes first, then two more after five steps
        assert len(ctx.episodes) == 3 and ctx.env_episode == 6 and ctx.env_step == 30
        assert all(len(episode.reward) == 5 for episode in ctx.episodes)
    finally:
        env.close()


def test_episode_collector_needs_n_episode(cfg, policy, cartpole_envs):
    with pytest.raises(ValueError, match="n_episode"):
        EpisodeCollector(cfg, policy.collect_mode, cartpole_envs(2))


def test_exponential_eps_decays_from_start_to_end(cfg):
    cfg.policy.other.eps.update(kind="exp", start=1.0, end=0.1, decay=100)
    handler = eps_greedy_handler(cfg)
    ctx = OnlineRLContext()
    handler(ctx)
    assert ctx.collect_kwargs["eps"] == pytest.approx(1.0)
    ctx.env_step = 100
    handler(ctx)
    assert ctx.collect_kwargs["eps"] == pytest.approx(0.1 + 0.9 * math.exp(-1))


def test_linear_eps_reaches_end_after_decay_steps(cfg):
    cfg.policy.other.eps.update(kind="linear", start=1.0, end=0.1, decay=100)
    handler = eps_greedy_handler(cfg)
    ctx = OnlineRLContext()
    ctx.env_step = 50
    handler(ctx)
    assert ctx.collect_kwargs["eps"] == pytest.approx(0.55)
    ctx.env_step = 1000
    handler(ctx)
    assert ctx.collect_kwargs["eps"] == pytest.approx(0.1)


def test_a_restored_step_collector_collects_what_the_original_would_have(cfg, policy, cartpole_envs):
    ctx = OnlineRLContext()
    original = StepCollector(cfg, policy.collect_mode, cartpole_envs(4), random_collect_size=10**6)
    original(ctx)
    state = original.state_dict()
    original(ctx)
    expected = ctx.trajectories

    resumed = StepCollector(cfg, policy.collect_mode, cartpole_envs(4), random_collect_size=10**6)
    resumed.load_state_dict(state)
    resumed(ctx)
    for key in ("obs", "action", "reward", "next_obs", "terminated", "truncated"):
        assert np.array_equal(ctx.trajectories[key].numpy(), expected[key].numpy()), key


def test_a_restored_episode_collector_goes_on_with_the_running_episodes(cfg, policy, cartpole_envs):
    cfg.policy.collect.n_episode = 2
    ctx = OnlineRLContext()
    ctx.collect_kwargs = {"eps": 0.0}
    original = EpisodeCollector(cfg, policy.collect_mode, cartpole_envs(3))
    original(ctx)
    state = original.state_dict()
    original(ctx)
    expected = [ep.reward.numpy() for ep in ctx.episodes]

    resumed = EpisodeCollector(cfg, policy.collect_mode, cartpole_envs(3))
    resumed.load_state_dict(state)
    resumed(ctx)
    assert [len(r) for r in expected] == [len(ep.reward) for ep in ctx.episodes]
    assert all(np.array_equal(a, b.reward.numpy()) for a, b in zip(expected, ctx.episodes))


def test_a_collector_saved_before_its_first_call_starts_with_a_reset(cfg, policy, cartpole_envs):
    collector = StepCollector(cfg, policy.collect_mode, cartpole_envs(2))
    assert collector.state_dict()["env"] is None
    collector.load_state_dict({"env": None})
    ctx = OnlineRLContext()
    ctx.collect_kwargs = {"eps": 0.5}
    collector(ctx)
    assert ctx.env_step == 16
