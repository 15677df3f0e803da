"""Env manager checkpoints: state_dict / load_state_dict go on exactly where the envs were, in either manager."""
from __future__ import annotations

import logging
import threading

import gymnasium as gym
import numpy as np
import pytest

from conveyor.envs import Restored


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


class Unpicklable(gym.Wrapper):
    """CartPole holding a lock, so pickling it fails."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.lock = threading.Lock()


def run(envs, steps: int, seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ts = envs.step(rng.integers(0, 2, envs.env_num))
        out.append((ts.obs.copy(), ts.reward.copy(), ts.terminated.copy(), ts.truncated.copy()))
    return out


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(all(np.array_equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b))


@pytest.mark.parametrize("source, target", [("sync", "sync"), ("subprocess", "subprocess"),
                                            ("sync", "subprocess")])
def test_a_restored_manager_continues_the_same_trajectories(managers, source, target):
    straight = managers(source, [cartpole] * 3, num_workers=2) if source == "subprocess" else \
        managers(source, [cartpole] * 3)
    straight.reset(seed=5)
    run(straight, 30, seed=1)
    state = straight.state_dict()
    expected = run(straight, 60, seed=2)

    kwargs = {"num_workers": 2} if target == "subprocess" else {}
    resumed = managers(target, [cartpole] * 3, **kwargs)
    restored = resumed.load_state_dict(state)
    assert isinstance(restored, Restored) and restored.reseeded == []
    assert np.array_equal(restored.obs, state["obs"])
    assert same(run(resumed, 60, seed=2), expected)
    assert resumed.stats == straight.stats


def test_state_dict_holds_the_episode_bookkeeping(managers, kind):
    envs = managers(kind, [cartpole] * 2)
    envs.reset(seed=0)
    run(envs, 3)
    state = envs.state_dict()
    assert state["per_env"]["lengths"] == [3, 3] and state["stats"]["env_steps"] == 6


def test_envs_that_do_not_pickle_are_reseeded_from_the_env_step_and_logged(managers, kind, caplog):
    envs = managers(kind, [Unpicklable] * 2)
    initial = envs.reset(seed=0)
    run(envs, 4)
    state = envs.state_dict()
    assert state["per_env"]["envs"] == [None, None]

    resumed = managers(kind, [Unpicklable] * 2)
    with caplog.at_level(logging.WARNING, logger="conveyor.envs"):
        restored = resumed.load_state_dict(state)
    assert restored.reseeded == [0, 1]
    assert "could not be restored" in caplog.text
    assert not np.array_equal(restored.obs, initial)  # never the initial episodes again
    assert state["per_env"]["lengths"] == [4, 4]
    run(resumed, 2)
    assert resumed.state_dict()["per_env"]["lengths"] == [2, 2]


def test_state_of_another_env_count_is_refused(managers, kind):
    envs = managers(kind, [cartpole] * 2)
    envs.reset(seed=0)
    state = envs.state_dict()
    with pytest.raises(ValueError, match="same env count"):
        managers(kind, [cartpole] * 3).load_state_dict(state)


def test_state_dict_before_reset_is_an_error(managers, kind):
    with pytest.raises(RuntimeError, match="before reset"):
        managers(kind, [cartpole]).state_dict()
