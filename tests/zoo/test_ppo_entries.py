"""PPO zoo entries: smoke runs of each, resume with the observation normaliser, the masked env, and runs that learn."""
import copy

import gymnasium as gym
import pytest

from conveyor.cli import main as cli_main
from conveyor.middleware import load_checkpoint
from conveyor.zoo import load_entry
from conveyor.zoo.cartpole_masked import ENV_ID

ENTRIES = ["cartpole/ppo", "pendulum/ppo", "cartpole_masked/ppo", "cartpole_masked/ppo_gru"]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def small(name, **policy):
    """The entry's config with short rollouts and few epochs, for smoke runs."""
    cfg = copy.deepcopy(load_entry(name).main_config)
    cfg.env.collector_env_num = 4
    cfg.env.evaluator_env_num = 2
    cfg.env.n_evaluator_episode = 2
    cfg.policy.collect.n_sample = 128
    cfg.policy.learn.epoch_per_collect = 2
    cfg.policy.learn.batch_size = 64
    cfg.policy.eval.evaluator.eval_freq = 4
    for key, value in policy.items():
        cfg.policy[key].update(value)
    return cfg


@pytest.mark.parametrize("name", ENTRIES)
def test_smoke_run_of_each_entry_writes_logs_and_checkpoints(in_tmp, name):
    entry = load_entry(name)
    ctx = entry.main(small(name), exp_name="smoke", max_env_step=256, progress=False)
    assert ctx.env_step >= 256 and ctx.train_iter > 0 and ctx.last_eval_value is not None
    run = in_tmp / "runs" / "smoke"
    assert (run / "ckpt" / "final.pth.tar").is_file()
    assert list((run / "tb").glob("events.out.tfevents.*"))


def test_smoke_run_in_async_mode(in_tmp):
    ctx = load_entry("cartpole_masked/ppo_gru").main(small("cartpole_masked/ppo_gru"), exp_name="async",
                                                     max_env_step=384, async_mode=True, progress=False)
    assert ctx.env_step >= 384 and ctx.train_iter > 0


def test_resume_restores_the_observation_normaliser_and_goes_on(in_tmp):
    entry = load_entry("pendulum/ppo")
    cfg = small("pendulum/ppo")
    first = entry.main(cfg, exp_name="resumed", max_env_step=256, progress=False)
    latest = in_tmp / "runs" / "resumed" / "ckpt" / "latest.pth.tar"
    saved = load_checkpoint(latest)["objects"]["policy"]["obs_normaliser"]
    seen = saved["stats"]["count"] + saved["pending"]["count"]
    assert seen == first.env_step  # every collected observation is in the statistics or waiting to join them
    second = entry.main(cfg, exp_name="resumed", max_env_step=512, resume=True, progress=False)
    assert second.env_step >= 512 and second.train_iter > first.train_iter
    resumed = load_checkpoint(latest)["objects"]["policy"]["obs_normaliser"]
    assert resumed["stats"]["count"] + resumed["pending"]["count"] == second.env_step


def test_cli_trains_a_ppo_entry(in_tmp, capsys):
    assert cli_main(["train", "cartpole/ppo", "--exp-name", "cli", "--max-env-step", "256", "--no-progress"]) == 0
    assert "budget reached: env step " in capsys.readouterr().out


def test_masked_cartpole_keeps_position_and_angle_only():
    env = gym.make(ENV_ID)
    try:
        obs, _ = env.reset(seed=0)
        assert env.observation_space.shape == (2,) and obs.shape == (2,)
        full = gym.make("CartPole-v1")
        full_obs, _ = full.reset(seed=0)
        assert obs.tolist() == full_obs[[0, 2]].tolist()
        assert env.spec.max_episode_steps == 500
    finally:
        env.close()


def reaching(name, stop_value, eval_every):
    """The entry's config, stopping at the first evaluation (every ``eval_every`` env steps) >= ``stop_value``."""
    cfg = copy.deepcopy(load_entry(name).main_config)
    cfg.env.stop_value = stop_value
    cfg.policy.eval.evaluator.eval_env_step_freq = eval_every
    return cfg


@pytest.mark.slow
def test_ppo_solves_cartpole(in_tmp):
    ctx = load_entry("cartpole/ppo").main(reaching("cartpole/ppo", 475.0, 2000), exp_name="learns", seed=0,
                                          max_env_step=50000, progress=False)
    assert ctx.last_eval_value >= 475, ctx.last_eval_value


@pytest.mark.slow
def test_ppo_learns_pendulum(in_tmp):
    ctx = load_entry("pendulum/ppo").main(reaching("pendulum/ppo", -600.0, 4096), exp_name="learns", seed=0,
                                          max_env_step=60000, progress=False)
    assert ctx.last_eval_value >= -600, ctx.last_eval_value


@pytest.mark.slow
def test_recurrent_ppo_learns_masked_cartpole(in_tmp):
    name = "cartpole_masked/ppo_gru"
    ctx = load_entry(name).main(reaching(name, 300.0, 2048), exp_name="learns", seed=0, max_env_step=40000,
                                progress=False)
    assert ctx.last_eval_value >= 300, ctx.last_eval_value


def test_an_async_run_collecting_in_a_process_checkpoints_and_resumes(in_tmp):
    entry = load_entry("pendulum/ppo")  # its observation statistics travel to the collector process with the weights
    cfg = small("pendulum/ppo")
    cfg.env.async_collector = "process"
    first = entry.main(cfg, exp_name="async", max_env_step=256, async_mode=True, progress=False)
    state = load_checkpoint(in_tmp / "runs" / "async" / "ckpt" / "latest.pth.tar")
    saved = [v for v in state["middleware"].values() if isinstance(v, dict) and set(v) == {"chain", "collect"}]
    assert saved and saved[0]["collect"]["rng"]  # the child chain's state and its replica's collect state
    second = entry.main(cfg, exp_name="async", max_env_step=512, resume=True, async_mode=True, progress=False)
    assert second.env_step >= 512 and second.train_iter > first.train_iter
