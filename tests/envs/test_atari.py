"""Atari (ale-py) and MuJoCo envs through make_env_manager: preprocessing, full-game returns, clipping only for
the collector, checkpoints, and the one-line errors for a missing extra."""
from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest

from conveyor.envs import check_env_id, env_factory, make_env_manager
from conveyor.schema import ConfigError
from tests.cli_helpers import run_conveyor

BREAKOUT = {"env_id": "ALE/Breakout-v5", "collector_env_num": 1, "evaluator_env_num": 1}


def _actions(n_actions: int, steps: int, env_num: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_actions, (steps, env_num))


def test_atari_observations_are_uint8_frame_stacks_channels_first(managers):
    envs = make_env_manager({**BREAKOUT, "collector_env_num": 2}, "collector", seed=0)
    managers.track(envs)
    obs = envs.reset()
    assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
    ts = envs.step(np.array([1, 1]))
    assert ts.obs.shape == ts.next_obs.shape == (2, 4, 84, 84) and ts.next_obs.dtype == np.uint8
    small = env_factory({**BREAKOUT, "atari": {"frame_stack": 2, "screen_size": 64}})()
    assert small.observation_space.shape == (2, 64, 64) and small.observation_space.dtype == np.uint8
    small.close()


def test_life_loss_ends_training_episodes_but_the_episode_info_is_the_whole_unclipped_game(managers):
    cfg = {**BREAKOUT, "atari": {"terminal_on_life_loss": True, "clip_reward": False}}
    envs = make_env_manager(cfg, "collector", seed=3)
    managers.track(envs)
    envs.reset()
    total, steps, ends = 0.0, 0, 0
    for action in _actions(4, 2000):
        ts = envs.step(action)
        total += float(ts.reward[0])
        steps += 1
        if ts.done[0]:
            ends += 1
            if "episode" in ts.info[0]:
                break
            assert ts.info[0]["lives"] > 0 and "game" not in ts.info[0]
    assert ts.info[0]["lives"] == 0 and ends == 5  # Breakout: one training episode per life
    assert ts.info[0]["episode"] == {"r": total, "l": steps} and total > 0
    assert envs.stats.episodes == 1


def test_rewards_are_clipped_and_lives_end_episodes_only_in_the_collectors_envs(managers):
    cfg = {"env_id": "ALE/SpaceInvaders-v5", "collector_env_num": 1, "evaluator_env_num": 1,
           "atari": {"terminal_on_life_loss": True, "clip_reward": True}}
    collector = make_env_manager(cfg, "collector", seed=3)
    evaluator = make_env_manager(cfg, "evaluator", seed=3)
    managers.track(collector)
    managers.track(evaluator)
    collector.reset()
    evaluator.reset()
    clipped, raw = [], []
    for action in _actions(6, 700):
        a, b = collector.step(action), evaluator.step(action)
        clipped.append(a.reward[0])
        raw.append(b.reward[0])
        assert not b.done[0]
        if a.done[0]:
            break
    else:
        pytest.fail("the collector's env lost no life")
    assert a.info[0]["lives"] == 2 and "episode" not in a.info[0]  # a life lost, the game goes on
    assert max(raw) > 1 and clipped == list(np.sign(raw))  # the same game, stepped alike


@pytest.mark.parametrize("manager", ["sync", pytest.param("subprocess", marks=pytest.mark.slow)])
def test_atari_envs_resume_from_a_checkpoint_exactly(managers, manager):
    cfg = {**BREAKOUT, "manager": manager, "atari": {"terminal_on_life_loss": True}}
    actions = _actions(4, 100)
    envs = make_env_manager(cfg, "collector", seed=1)
    managers.track(envs)
    envs.reset()
    for action in actions[:50]:
        envs.step(action)
    state = pickle.loads(pickle.dumps(envs.state_dict()))
    resumed = make_env_manager(cfg, "collector", seed=9)
    managers.track(resumed)
    resumed.reset()
    assert resumed.load_state_dict(state).reseeded == []
    for action in actions[50:]:
        a, b = envs.step(action), resumed.step(action)
        assert (a.obs == b.obs).all() and (a.next_obs == b.next_obs).all() and (a.reward == b.reward).all()
        assert (a.done == b.done).all() and [i.get("episode") for i in a.info] == [i.get("episode") for i in b.info]


def test_the_subprocess_manager_steps_atari_envs_as_the_sync_one_does(managers):
    cfg = {**BREAKOUT, "atari": {"terminal_on_life_loss": True}}
    sync = make_env_manager(cfg, "collector", seed=5)
    sub = make_env_manager({**cfg, "manager": "subprocess"}, "collector", seed=5)
    managers.track(sync)
    managers.track(sub)
    assert (sync.reset() == sub.reset()).all()
    for action in _actions(4, 60):
        a, b = sync.step(action), sub.step(action)
        assert (a.obs == b.obs).all() and (a.next_obs == b.next_obs).all() and (a.reward == b.reward).all()
        assert (a.done == b.done).all() and [i.get("episode") for i in a.info] == [i.get("episode") for i in b.info]


def test_mujoco_half_cheetah_steps_through_the_sync_manager(managers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MuJoCo writes its warnings to MUJOCO_LOG.TXT in the working directory
    envs = make_env_manager({"env_id": "HalfCheetah-v5", "collector_env_num": 2, "max_episode_steps": 5},
                            "collector", seed=0)
    managers.track(envs)
    assert envs.reset().shape == (2, 17)
    for t in range(5):
        ts = envs.step(np.zeros((2, 6), np.float32))
    assert ts.truncated.all() and ts.next_obs.shape == (2, 17)
    assert [info["episode"]["l"] for info in ts.info] == [5, 5]


def test_building_a_half_cheetah_prints_no_settotalmass_warning_and_writes_no_mujoco_log(tmp_path, monkeypatch,
                                                                                       capfd):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        env_factory({"env_id": "HalfCheetah-v5"})().close()
    err = capfd.readouterr().err
    assert "settotalmass" not in err, err
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()


@pytest.mark.parametrize("env_id, hint", [("Pong-v5", "ALE/Pong-v5"), ("pong", "ALE/Pong-v5"),
                                         ("breakout-v5", "ALE/Breakout-v5")])
def test_an_atari_game_named_without_ale_gets_the_ale_id_as_its_hint(env_id, hint):
    with pytest.raises(ConfigError, match=f"'{env_id}', which is not a registered Gymnasium env: did you mean "
                                          f"'{hint}'\\?"):
        check_env_id(env_id)


def test_an_atari_command_prints_no_ale_banner(tmp_path):
    done = run_conveyor(["conveyor", "describe", "atari/dqn"], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "A.L.E" not in done.stderr + done.stdout and "Stella" not in done.stderr, done.stderr


@pytest.mark.parametrize("env_id, module, extra", [("ALE/Breakout-v5", "ale_py", "atari"),
                                                   ("ALE/Breakout-v5", "cv2", "atari"),
                                                   ("HalfCheetah-v5", "mujoco", "mujoco")])
def test_a_missing_extra_is_a_one_line_error_with_the_install_command(monkeypatch, env_id, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ConfigError, match=f'pip install "conveyor\\[{extra}\\]"') as info:
        check_env_id(env_id)
    assert "\n" not in str(info.value) and env_id in str(info.value)


def test_atari_options_are_checked_with_their_full_key():
    with pytest.raises(ConfigError, match="did you mean 'env.atari.frame_skip'"):
        make_env_manager({**BREAKOUT, "atari": {"frameskip": 4}}, "collector")
    with pytest.raises(ConfigError, match="env.atari.frame_skip"):
        make_env_manager({**BREAKOUT, "env_kwargs": {"frameskip": 2}}, "collector")


@pytest.mark.parametrize("fire_reset", [False, True])
def test_fire_reset_launches_breakouts_ball_at_the_start_and_after_each_lost_life(managers, fire_reset):
    cfg = {**BREAKOUT, "atari": {"fire_reset": fire_reset, "terminal_on_life_loss": True}}
    envs = make_env_manager(cfg, "collector", seed=0)
    managers.track(envs)
    envs.reset()
    ends = sum(int(envs.step(np.zeros(1, int)).done[0]) for _ in range(100))  # NOOP only: the agent never fires
    assert ends >= 3 if fire_reset else ends == 0


def test_fire_reset_relaunches_the_ball_after_a_lost_life_in_whole_games(managers):
    """Evaluator envs play whole games: FIRE after each lost life too, so a NOOP-only agent loses all its lives."""
    cfg = {**BREAKOUT, "atari": {"fire_reset": True}, "max_episode_steps": 3000}
    envs = make_env_manager(cfg, "evaluator", seed=0)
    managers.track(envs)
    envs.reset()
    for step in range(3000):
        ts = envs.step(np.zeros(1, int))
        if ts.done[0]:
            break
    assert ts.terminated[0] and not ts.truncated[0], "the game should end by losing every life, not by the limit"
    assert ts.info[0]["episode"]["l"] == step + 1
