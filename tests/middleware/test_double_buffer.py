"""EnvGroups: two env managers stepped as one, for collectors double-buffered against an inference server."""
import gymnasium as gym
import numpy as np

from conveyor.envs import SyncEnvManager
from conveyor.middleware.double_buffer import EnvGroups


def cartpoles(n, seed=None):
    return SyncEnvManager([lambda: gym.make("CartPole-v1")] * n, seed=seed)


def test_two_groups_reset_and_step_as_one_manager_of_all_their_envs():
    actions = np.array([0, 1, 1, 0, 1])
    with EnvGroups(cartpoles(2), cartpoles(3)) as groups, cartpoles(5) as one:
        assert groups.env_num == 5 and groups.action_space == one.action_space
        np.testing.assert_array_equal(groups.reset(seed=7), one.reset(seed=7))
        for _ in range(30):  # through episode ends
            mine, theirs = groups.step(actions), one.step(actions)
            for field in ("obs", "next_obs", "reward", "terminated", "truncated", "crashed"):
                np.testing.assert_array_equal(getattr(mine, field), getattr(theirs, field))
            assert [sorted(i) for i in mine.info] == [sorted(i) for i in theirs.info]


def test_a_saved_state_goes_on_where_it_was():
    actions = np.array([1, 0, 1])
    with EnvGroups(cartpoles(1), cartpoles(2)) as groups, EnvGroups(cartpoles(1), cartpoles(2)) as again:
        groups.reset(seed=3)
        groups.step(actions)
        restored = again.load_state_dict(groups.state_dict())
        assert restored.reseeded == [] and restored.obs.shape == (3, 4)
        for _ in range(5):
            np.testing.assert_array_equal(again.step(actions).obs, groups.step(actions).obs)


def test_closing_the_groups_closes_both_managers():
    first, second = cartpoles(1), cartpoles(1)
    EnvGroups(first, second).close()
    assert first.closed and second.closed
