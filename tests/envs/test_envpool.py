"""env.manager 'envpool': the Timestep protocol over envpool's next-step auto-reset, full-game returns, clipping,
seeds, checkpoints and the one-line errors."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from conveyor.envs import EnvpoolEnvManager, make_env_manager
from conveyor.schema import ConfigError

envpool = pytest.importorskip("envpool")

ATARI = {"env_id": "ALE/Breakout-v5", "manager": "envpool", "collector_env_num": 1, "evaluator_env_num": 1}


def _random_actions(steps: int, env_num: int = 1, n: int = 4) -> np.ndarray:
    return np.random.default_rng(0).integers(0, n, (steps, env_num))


def test_an_ended_episode_gives_its_final_obs_as_next_obs_and_the_new_episodes_first_obs_as_obs(managers):
    cfg = {**ATARI, "atari": {"terminal_on_life_loss": True, "clip_reward": True}}
    envs = make_env_manager(cfg, "collector", seed=4)
    managers.track(envs)
    assert isinstance(envs, EnvpoolEnvManager) and envs.observation_space.shape == (4, 84, 84)
    pool = envpool.make("Breakout-v5", env_type="gymnasium", num_envs=1, batch_size=1, seed=4, episodic_life=True,
                        reward_clip=True, repeat_action_probability=0.25, use_fire_reset=False)
    assert (envs.reset() == pool.reset()[0]).all()
    ends = 0
    for action in _random_actions(200):
        ts = envs.step(action)
        final, reward, terminated, _, _ = pool.step(action)
        assert (ts.next_obs == final).all() and ts.reward[0] == reward[0] and ts.terminated[0] == terminated[0]
        if ts.done[0]:
            ends += 1
            first = pool.step(np.zeros(1, int))[0]  # envpool's reset step: the action is ignored
            assert (ts.obs == first).all() and not (ts.obs == ts.next_obs).all()
        else:
            assert (ts.obs == ts.next_obs).all()
    assert ends >= 2


def test_envpool_atari_episodes_are_whole_unclipped_games_and_only_collector_rewards_are_clipped(managers):
    cfg = {**ATARI, "env_id": "ALE/SpaceInvaders-v5", "atari": {"terminal_on_life_loss": True, "clip_reward": True}}
    collector = make_env_manager(cfg, "collector", seed=3)
    evaluator = make_env_manager(cfg, "evaluator", seed=3)
    managers.track(collector)
    managers.track(evaluator)
    for envs, clipped, ends_per_game in ((collector, True, 3), (evaluator, False, 1)):
        envs.reset()
        rewards, ends = [], 0
        for action in _random_actions(2000, n=6):
            ts = envs.step(action)
            rewards.append(float(ts.reward[0]))
            ends += int(ts.done[0])
            if "episode" in ts.info[0]:
                break
        assert ends == ends_per_game  # SpaceInvaders: three lives
        assert ts.info[0]["episode"]["l"] == len(rewards)
        if clipped:
            assert set(rewards) <= {0.0, 1.0} and ts.info[0]["episode"]["r"] > sum(rewards)
        else:
            assert max(rewards) > 1 and ts.info[0]["episode"]["r"] == sum(rewards)


def test_envpool_mujoco_half_cheetah_truncates_and_reports_its_episode(managers):
    envs = make_env_manager({"env_id": "HalfCheetah-v5", "manager": "envpool", "collector_env_num": 2,
                             "max_episode_steps": 5}, "collector", seed=0)
    managers.track(envs)
    assert envs.reset().shape == (2, 17)
    total = np.zeros(2)
    for _ in range(5):
        ts = envs.step(np.full((2, 6), 0.5, np.float32))
        total += ts.reward
    assert ts.truncated.all() and (ts.obs != ts.next_obs).any(axis=1).all()
    assert [info["episode"]["l"] for info in ts.info] == [5, 5]
    assert np.allclose([info["episode"]["r"] for info in ts.info], total)


def test_a_reset_with_a_seed_replays_the_same_episodes(managers):
    envs = make_env_manager(ATARI, "collector", seed=1)
    managers.track(envs)
    runs = []
    for _ in range(2):
        obs = [envs.reset(seed=11)]
        obs += [envs.step(action).obs for action in _random_actions(30)]
        runs.append(np.stack(obs))
    assert (runs[0] == runs[1]).all()


def test_a_resume_starts_new_episodes_seeded_from_the_run_seed_and_env_step(managers):
    envs = make_env_manager(ATARI, "collector", seed=1)
    managers.track(envs)
    envs.reset()
    for action in _random_actions(20):
        envs.step(action)
    state = envs.state_dict()
    assert state["per_env"]["envs"] == [None]
    resumed = make_env_manager(ATARI, "collector", seed=1)
    managers.track(resumed)
    restored = resumed.load_state_dict(state)
    assert restored.reseeded == [0] and restored.obs.shape == (1, 4, 84, 84)
    assert resumed.stats.env_steps == 20
    resumed.step(np.zeros(1, int))


def test_seeds_beyond_int32_build_a_pool(managers):
    envs = make_env_manager(ATARI, "collector", seed=2**32 - 1)  # a valid run seed; a resume's reseed is as large
    managers.track(envs)
    first = envs.reset()
    again = envs.reset(seed=2**32 - 1)
    assert first.shape == (1, 4, 84, 84) and (first == again).all()


def test_a_missing_envpool_is_a_one_line_error_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "envpool", None)
    with pytest.raises(ConfigError, match='pip install "conveyor\\[envpool\\]"'):
        make_env_manager(ATARI, "collector")


def test_an_env_envpool_does_not_provide_is_a_config_error():
    with pytest.raises(ConfigError, match="did you mean 'Breakout-v5'"):
        make_env_manager({**ATARI, "env_id": "ALE/Breakot-v5"}, "collector")
