"""SyncEnvManager and SubprocessEnvManager: the protocol of docs/design.md, seeding, nesting and crashes."""
from __future__ import annotations

import functools
import gc
import os
import signal

import gymnasium as gym
import numpy as np
import pytest

from conveyor.envs import EnvCrashedError, EnvManagerStats, SubprocessEnvManager, SyncEnvManager, Timestep
from .env_helpers import CountingEnv, FirstResetFails, HangingEnv, NestedEnv


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def flaky(raise_every: int, length: int = 5) -> functools.partial:
    return functools.partial(CountingEnv, length=length, raise_every=raise_every)


def zeros(n: int) -> np.ndarray:
    return np.zeros(n, np.int64)


def test_reset_returns_observations_with_a_leading_env_dimension(managers, kind):
    envs = managers(kind, [cartpole] * 3)
    obs = envs.reset(seed=0)
    assert obs.shape == (3, 4) and obs.dtype == np.float32


def test_step_returns_a_timestep_with_one_row_per_env(managers, kind):
    envs = managers(kind, [cartpole] * 3)
    envs.reset(seed=0)
    step = envs.step(np.array([0, 1, 0]))
    assert isinstance(step, Timestep)
    assert step.obs.shape == step.next_obs.shape == (3, 4)
    assert step.reward.dtype == np.float32 and step.reward.shape == (3,)
    assert all(flag.dtype == np.bool_ and flag.shape == (3,)
               for flag in (step.terminated, step.truncated, step.crashed))
    assert isinstance(step.info, list) and len(step.info) == 3 and all(isinstance(i, dict) for i in step.info)


def test_manager_exposes_single_env_spaces_and_env_num(managers, kind):
    envs = managers(kind, [cartpole] * 3)
    assert envs.env_num == 3
    assert envs.observation_space == gym.make("CartPole-v1").observation_space
    assert envs.action_space == gym.spaces.Discrete(2)
    assert envs.env_id == "CartPole-v1"


def test_reset_with_seed_seeds_env_i_with_seed_plus_i(managers, kind):
    envs = managers(kind, [cartpole] * 3)
    obs = envs.reset(seed=10)
    expected = [gym.make("CartPole-v1").reset(seed=10 + i)[0] for i in range(3)]
    np.testing.assert_array_equal(obs, np.stack(expected))


def test_constructor_seed_is_used_by_the_first_reset_without_seed(managers, kind):
    envs = managers(kind, [cartpole] * 2, seed=5)
    expected = managers("sync", [cartpole] * 2).reset(seed=5)
    np.testing.assert_array_equal(envs.reset(), expected)


def test_same_seed_and_actions_give_the_same_trajectory_twice(managers):
    actions = np.random.default_rng(0).integers(0, 2, (60, 3))
    runs = []
    for _ in range(2):
        envs = managers("sync", [cartpole] * 3)
        frames = [envs.reset(seed=1)]
        frames += [envs.step(a).obs for a in actions]
        runs.append(np.stack(frames))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_sync_and_subprocess_give_identical_trajectories_including_crashes(managers):
    actions = np.random.default_rng(0).integers(0, 2, (40, 4))
    results = []
    for kind in ("sync", "subprocess"):
        envs = managers(kind, [flaky(raise_every=7)] * 4, **({"num_workers": 2} if kind == "subprocess" else {}))
        frames = [envs.reset(seed=3)]
        for a in actions:
            step = envs.step(a)
            frames.append((step.obs, step.next_obs, step.reward, step.terminated, step.truncated, step.crashed,
                           step.info))
        results.append((frames, envs.stats))
    (sync_frames, sync_stats), (sub_frames, sub_stats) = results
    np.testing.assert_array_equal(sync_frames[0], sub_frames[0])
    for a, b in zip(sync_frames[1:], sub_frames[1:]):
        for x, y in zip(a[:-1], b[:-1]):
            np.testing.assert_array_equal(x, y)
        assert a[-1] == b[-1]
    assert sync_stats == sub_stats and sync_stats.crashes > 0


def test_episode_end_puts_final_obs_in_next_obs_and_first_obs_of_next_episode_in_obs(managers, kind):
    envs = managers(kind, [functools.partial(CountingEnv, length=2)] * 2)
    envs.reset(seed=0)
    envs.step(zeros(2))
    step = envs.step(zeros(2))
    assert step.terminated.all() and not step.truncated.any()
    np.testing.assert_array_equal(step.next_obs[:, 0], [2, 2])
    np.testing.assert_array_equal(step.obs[:, 0], [0, 0])
    assert step.info[0]["episode"] == {"r": 2.0, "l": 2}
    assert "start" in step.info[0]["reset_info"]


def test_time_limit_sets_truncated_not_terminated(managers, kind):
    counting = "tests.envs.env_helpers:ConveyorTest/Counting-v0"  # the module part registers it in any process
    envs = managers(kind, [functools.partial(gym.make, counting, length=100, max_episode_steps=3)] * 2)
    envs.reset(seed=0)
    steps = [envs.step(zeros(2)) for _ in range(3)]
    assert steps[-1].truncated.all() and not steps[-1].terminated.any()
    assert not any(s.truncated.any() for s in steps[:-1])
    np.testing.assert_array_equal(steps[-1].next_obs[:, 0], [3, 3])


def test_returned_arrays_are_not_overwritten_by_later_steps(managers, kind):
    envs = managers(kind, [flaky(raise_every=0, length=100)] * 2)
    first = envs.reset(seed=0)
    step = envs.step(zeros(2))
    kept = (first.copy(), step.obs.copy(), step.reward.copy())
    envs.step(np.ones(2, np.int64))
    np.testing.assert_array_equal(first, kept[0])
    np.testing.assert_array_equal(step.obs, kept[1])
    np.testing.assert_array_equal(step.reward, kept[2])


def test_dict_and_tuple_observations_batch_as_nested_dicts(managers, kind):
    envs = managers(kind, [NestedEnv] * 3)
    obs = envs.reset(seed=0)
    assert set(obs) == {"pos", "inner"} and set(obs["inner"]) == {"0", "1"}
    assert obs["pos"].shape == (3, 2) and obs["pos"].dtype == np.float32
    assert obs["inner"]["0"].shape == (3,) and obs["inner"]["0"].dtype == np.int64
    assert obs["inner"]["1"]["bits"].shape == (3, 3) and obs["inner"]["1"]["bits"].dtype == np.int8
    single = NestedEnv()
    single.reset(seed=1)
    np.testing.assert_array_equal(obs["pos"][1], single._obs(np.zeros(2, np.float32))["pos"])


def test_tuple_actions_given_as_dicts_reach_each_env_as_tuples(managers, kind):
    envs = managers(kind, [NestedEnv] * 2)
    envs.reset(seed=0)
    step = envs.step({"0": np.array([1, 2]), "1": np.array([[0.5, 0.0], [-0.5, 0.0]], np.float32)})
    np.testing.assert_array_equal(step.reward, [1.0, 2.0])
    np.testing.assert_array_equal(step.obs["pos"][:, 1], [0.5, -0.5])
    np.testing.assert_array_equal(step.obs["inner"]["1"]["bits"], [[1, 0, 0], [1, 0, 0]])


def test_action_with_the_wrong_number_of_rows_is_a_value_error(managers, kind):
    envs = managers(kind, [cartpole] * 3)
    envs.reset(seed=0)
    with pytest.raises(ValueError, match=r"shape \(2,\), expected \(3,\)"):
        envs.step(np.zeros(2, np.int64))


def test_step_before_reset_is_an_error(managers, kind):
    envs = managers(kind, [cartpole] * 2)
    with pytest.raises(RuntimeError, match=r"before reset\(\)"):
        envs.step(zeros(2))


def test_closed_manager_refuses_to_step_and_closes_twice_quietly(managers, kind):
    envs = managers(kind, [cartpole] * 2)
    envs.reset(seed=0)
    envs.close()
    envs.close()
    assert envs.closed
    with pytest.raises(RuntimeError, match="closed"):
        envs.reset()


def test_context_manager_closes_the_manager(kind):
    cls = SyncEnvManager if kind == "sync" else SubprocessEnvManager
    with cls([cartpole] * 2) as envs:
        envs.reset(seed=0)
    assert envs.closed


def test_closing_a_subprocess_manager_ends_its_worker_processes(managers):
    envs = managers("subprocess", [cartpole] * 2, num_workers=2)
    pids = envs.worker_pids
    envs.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_subprocess_manager_dropped_without_close_stops_its_workers():
    envs = SubprocessEnvManager([cartpole] * 2, num_workers=2)
    pids = envs.worker_pids
    del envs
    gc.collect()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_subprocess_manager_splits_envs_into_groups_per_worker(managers):
    envs = managers("subprocess", [cartpole] * 5, num_workers=2)
    assert envs.num_workers == 2 and len(set(envs.worker_pids)) == 2
    assert envs.reset(seed=0).shape == (5, 4)


def test_env_instances_instead_of_factories_are_a_type_error(kind):
    cls = SyncEnvManager if kind == "sync" else SubprocessEnvManager
    with pytest.raises(TypeError, match="not a factory"):
        cls([gym.make("CartPole-v1")] * 2)


def test_envs_with_different_spaces_are_a_value_error(kind):
    cls = SyncEnvManager if kind == "sync" else SubprocessEnvManager
    kwargs = {"num_workers": 2} if kind == "subprocess" else {}
    with pytest.raises(ValueError, match="must share their observation and action spaces"):
        cls([cartpole, lambda: gym.make("Acrobot-v1")], **kwargs)


def test_an_env_raising_in_step_is_rebuilt_and_its_row_marked_crashed(managers, kind):
    envs = managers(kind, [flaky(raise_every=0, length=100), flaky(raise_every=2, length=100)])
    envs.reset(seed=0)
    envs.step(zeros(2))
    step = envs.step(zeros(2))
    np.testing.assert_array_equal(step.crashed, [False, True])
    assert step.obs[1, 0] == 0 and step.obs[0, 0] == 2  # env 1 starts a new episode, env 0 goes on
    np.testing.assert_array_equal(step.next_obs[1], step.obs[1])
    assert step.reward[1] == 0 and not step.terminated[1] and not step.truncated[1]
    assert "failed on purpose" in step.info[1]["error"]
    assert envs.stats == EnvManagerStats(env_steps=4, crashes=1, dropped_episodes=1)
    assert not envs.step(zeros(2)).crashed.any()


def test_an_env_raising_in_reset_is_rebuilt_and_reset_succeeds(managers, kind):
    envs = managers(kind, [FirstResetFails(), FirstResetFails()])
    obs = envs.reset(seed=0)
    assert obs.shape == (2, 2) and envs.stats.crashes == 2 and envs.stats.dropped_episodes == 0


def test_failures_separated_by_successful_steps_do_not_use_up_max_retry(managers, kind):
    envs = managers(kind, [flaky(raise_every=2, length=100)], max_retry=1)
    envs.reset(seed=0)
    crashed = [envs.step(zeros(1)).crashed[0] for _ in range(8)]
    assert crashed == [False, True] * 4


def test_env_failing_more_than_max_retry_times_in_a_row_raises_env_crashed_error(managers, kind):
    envs = managers(kind, [flaky(raise_every=0), flaky(raise_every=1)], max_retry=2)
    envs.reset(seed=0)
    envs.step(zeros(2))
    envs.step(zeros(2))
    with pytest.raises(EnvCrashedError, match=r"env 1 \(CountingEnv\) gave up after 3 consecutive failures") as error:
        envs.step(zeros(2))
    assert error.value.env_index == 1
    assert "max_retry=2" in str(error.value) and "failed on purpose" in str(error.value)
    assert isinstance(error.value.__cause__, RuntimeError) and "failed on purpose" in str(error.value.__cause__)
    assert envs.closed


def test_max_retry_zero_raises_on_the_first_failure(managers, kind):
    envs = managers(kind, [flaky(raise_every=1)], max_retry=0)
    envs.reset(seed=0)
    with pytest.raises(EnvCrashedError, match="gave up after 1 consecutive failure,"):
        envs.step(zeros(1))


def test_factory_that_raises_is_an_env_crashed_error_naming_the_env(kind):
    cls = SyncEnvManager if kind == "sync" else SubprocessEnvManager
    with pytest.raises(EnvCrashedError, match="env 0 .* could not be built: ValueError: no such level") as error:
        cls([functools.partial(_raise, ValueError("no such level"))])
    assert isinstance(error.value.__cause__, ValueError)


def _raise(exc: Exception) -> gym.Env:
    raise exc


def test_killed_worker_is_respawned_and_its_envs_marked_crashed(managers):
    envs = managers("subprocess", [flaky(raise_every=0, length=100)] * 4, num_workers=2)
    envs.reset(seed=0)
    envs.step(zeros(4))
    victim = envs.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    step = envs.step(zeros(4))
    np.testing.assert_array_equal(step.crashed, [False, False, True, True])
    np.testing.assert_array_equal(step.obs[:, 0], [2, 2, 0, 0])
    np.testing.assert_array_equal(step.next_obs[2:], step.obs[2:])
    assert "SIGKILL" in step.info[2]["error"]
    assert envs.worker_pids[1] != victim
    assert envs.stats.worker_restarts == 1 and envs.stats.dropped_episodes == 2
    assert not envs.step(zeros(4)).crashed.any()


def test_killed_worker_beyond_max_retry_raises_env_crashed_error(managers):
    envs = managers("subprocess", [cartpole] * 2, num_workers=2, max_retry=0)
    envs.reset(seed=0)
    os.kill(envs.worker_pids[0], signal.SIGKILL)
    with pytest.raises(EnvCrashedError, match="worker process 0 was killed by SIGKILL"):
        envs.step(zeros(2))
    assert envs.closed


def test_hung_worker_is_killed_after_step_timeout_and_replaced(managers):
    envs = managers("subprocess", [functools.partial(HangingEnv, hang_at=2)] * 2, num_workers=1, step_timeout=0.3)
    envs.reset(seed=0)
    assert not envs.step(zeros(2)).crashed.any()
    step = envs.step(zeros(2))
    assert step.crashed.all() and "step_timeout=0.3" in step.info[0]["error"]
    assert envs.stats.worker_restarts == 1


def test_children_of_a_cuda_parent_are_spawned(monkeypatch):
    """A forked child cannot use CUDA: once the parent has initialised it, env workers and collector processes
    are spawned unless a start method was asked for."""
    import torch

    from conveyor.envs._subprocess import default_start_method
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert default_start_method(None) is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert default_start_method(None) == "spawn"
    assert default_start_method("fork") == "fork"
