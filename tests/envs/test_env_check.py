"""check_env: passes good envs, lists every problem of a bad one in one error."""
from __future__ import annotations

import gymnasium as gym
import pytest

from conveyor.envs import EnvCheckError, check_env
from .env_helpers import BrokenEnv, CountingEnv, NestedEnv, TextObsEnv


@pytest.mark.parametrize("env", ["CartPole-v1", NestedEnv, CountingEnv], ids=["id", "nested", "factory"])
def test_check_env_returns_none_for_a_correct_env(env):
    assert check_env(env) is None


def test_check_env_accepts_an_env_instance_and_leaves_it_open():
    env = gym.make("CartPole-v1")
    assert check_env(env) is None
    env.step(0)  # still usable: check_env does not close envs it did not build


def test_check_env_reports_every_problem_in_one_error():
    with pytest.raises(EnvCheckError) as error:
        check_env(BrokenEnv)
    problems = error.value.problems
    text = str(error.value)
    assert "shape (4,), expected (3,)" in text
    assert "reward '1.0' of type str" in text
    assert "terminated=0 of type int" in text and "truncated=0 of type int" in text
    assert "same seed" in text
    assert len(problems) >= 5 and text.count("\n  - ") == len(problems)


def test_check_env_reports_a_space_managers_cannot_batch():
    with pytest.raises(EnvCheckError, match="cannot be batched"):
        check_env(TextObsEnv)


def test_check_env_reports_an_unknown_id_with_the_closest_one():
    with pytest.raises(EnvCheckError, match="did you mean 'CartPole-v1'"):
        check_env("CartPole-v7")


def test_check_env_reports_a_factory_that_fails():
    with pytest.raises(EnvCheckError, match="building the env failed: ZeroDivisionError"):
        check_env(lambda: 1 / 0)
