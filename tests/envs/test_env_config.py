"""cfg.env: ENV_SCHEMA, check_env_id, EnvFactory and make_env_manager."""
from __future__ import annotations

import multiprocessing as mp

import gymnasium as gym
import pytest

from conveyor.envs import (ENV_SCHEMA, EnvFactory, SubprocessEnvManager, SyncEnvManager, check_env_id,
                           default_num_workers, make_env_manager)
from conveyor.schema import ConfigError, Option, defaults, validate

from . import env_helpers  # noqa: F401  (registers ConveyorTest/Counting-v0)


def test_every_env_option_has_a_one_line_doc():
    assert all(isinstance(o, Option) and o.doc and "\n" not in o.doc for o in ENV_SCHEMA.values())


def test_env_schema_defaults_match_the_documented_ones():
    cfg = defaults(ENV_SCHEMA)
    assert (cfg.env_id, cfg.collector_env_num, cfg.evaluator_env_num, cfg.n_evaluator_episode) == \
        ("CartPole-v1", 8, 5, 10)
    assert (cfg.manager, cfg.max_retry, cfg.stop_value, cfg.num_workers, cfg.max_episode_steps) == \
        ("sync", 3, None, None, None)
    assert cfg.env_kwargs == {}


@pytest.mark.parametrize("key, value", [("manager", "threads"), ("collector_env_num", 0), ("max_retry", -1),
                                        ("num_workers", 0), ("stop_value", "high")])
def test_env_schema_rejects_bad_values(key, value):
    with pytest.raises(ConfigError, match=f"env.{key}"):
        validate({key: value}, ENV_SCHEMA, "env")


def test_env_kwargs_accept_any_keys():
    assert validate({"env_kwargs": {"render_mode": None, "sutton_barto_reward": True}}, ENV_SCHEMA, "env").env_kwargs


def test_check_env_id_accepts_a_registered_id():
    assert check_env_id("CartPole-v1") is None


def test_check_env_id_names_the_closest_registered_id():
    with pytest.raises(ConfigError, match=r"'CartPol-v1'.*did you mean 'CartPole-v1'\?"):
        check_env_id("CartPol-v1")


def test_check_env_id_reports_a_missing_module_of_a_module_prefixed_id():
    with pytest.raises(ConfigError, match="module 'no_such_module' cannot be imported"):
        check_env_id("no_such_module:Thing-v0")


def test_env_factory_passes_kwargs_and_max_episode_steps_to_gym_make():
    env = EnvFactory("ConveyorTest/Counting-v0", {"length": 7}, max_episode_steps=3)()
    assert env.unwrapped.length == 7 and env.spec.max_episode_steps == 3


def test_make_env_manager_builds_a_sync_manager_with_collector_env_num(managers):
    envs = make_env_manager({"collector_env_num": 3}, "collector")
    managers.track(envs)
    assert isinstance(envs, SyncEnvManager) and envs.env_num == 3 and envs.env_id == "CartPole-v1"


def test_make_env_manager_builds_a_subprocess_manager_with_evaluator_env_num(managers):
    envs = make_env_manager({"manager": "subprocess", "evaluator_env_num": 2, "num_workers": 4}, "evaluator")
    managers.track(envs)
    assert isinstance(envs, SubprocessEnvManager) and envs.env_num == 2 and envs.num_workers == 2


def test_make_env_manager_uses_its_seed_for_the_first_reset(managers):
    envs = make_env_manager({"collector_env_num": 2}, "collector", seed=7)
    managers.track(envs)
    first = gym.make("CartPole-v1").reset(seed=7)[0]
    assert (envs.reset()[0] == first).all()


def test_make_env_manager_applies_env_kwargs_and_max_episode_steps(managers):
    cfg = {"env_id": "tests.envs.env_helpers:ConveyorTest/Counting-v0", "env_kwargs": {"length": 50},
           "max_episode_steps": 2, "collector_env_num": 1}
    envs = make_env_manager(cfg, "collector")
    managers.track(envs)
    envs.reset(seed=0)
    envs.step([0])
    assert envs.step([0]).truncated[0]


def test_make_env_manager_rejects_an_unknown_env_id_before_starting_anything():
    before = len(mp.active_children())
    with pytest.raises(ConfigError, match="did you mean 'CartPole-v1'"):
        make_env_manager({"env_id": "CartPol-v1", "manager": "subprocess"}, "collector")
    assert len(mp.active_children()) == before


def test_make_env_manager_rejects_an_unknown_role():
    with pytest.raises(ValueError, match="'collector' or 'evaluator'"):
        make_env_manager({}, "learner")  # type: ignore[arg-type]


def test_default_num_workers_never_exceeds_the_env_count():
    assert default_num_workers(1) == 1 and 1 <= default_num_workers(64) <= 64
