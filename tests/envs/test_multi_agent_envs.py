"""``mpe/...`` and ``vmas/...`` env ids through make_env_manager: batches ``[N_env, N_agent, ...]`` from both managers,
the env's own state, padding, continuous actions, exact resume, VMAS's random state per env, the one-line errors.

They need the ``marl`` extra (``pip install -e ".[marl]"``); where it is missing they are skipped, except under CI
(``$CI`` set), where the test extra installs it and they fail, saying why."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gymnasium import spaces

from conveyor.envs import check_env, make_env_manager
from conveyor.schema import ConfigError, Option

MISSING = [name for name in ("pettingzoo", "mpe2", "vmas") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(MISSING) and not os.environ.get("CI"),
                                reason=f"needs {MISSING} of the marl extra: pip install -e '.[marl]'")

SPREAD = {"env_id": "mpe/simple_spread_v3", "env_kwargs": {"max_cycles": 10}, "collector_env_num": 2}


@pytest.fixture(autouse=True)
def _marl_packages() -> None:
    if MISSING:
        pytest.fail(f"CI is set, so the multi-agent env tests must run, but {MISSING} are missing: install the "
                    f"test extra")


def _build(managers, cfg: dict, kind: str = "sync", seed: int | None = 0):
    envs = make_env_manager(dict(cfg, manager=kind), "collector", seed=seed)
    managers.track(envs)
    return envs


def _actions(envs, steps: int, seed: int = 0) -> list:
    envs.action_space.seed(seed)
    return [np.stack([envs.action_space.sample() for _ in range(envs.env_num)]) for _ in range(steps)]


def test_mpe_batches_have_env_and_agent_axes_in_both_managers(managers, kind):
    envs = _build(managers, SPREAD, kind)
    obs = envs.reset()
    assert {key: (value.shape, value.dtype) for key, value in obs.items()} == {
        "obs": ((2, 3, 18), np.float32), "state": ((2, 54), np.float32), "action_mask": ((2, 3, 5), np.bool_),
        "agent_mask": ((2, 3), np.bool_)}
    assert envs.action_space == spaces.MultiDiscrete([5, 5, 5])
    steps = [envs.step(action) for action in _actions(envs, 10)]
    assert steps[0].reward.shape == (2, 3) and steps[0].reward.dtype == np.float32
    assert [ts.done.tolist() for ts in steps].index([True, True]) == 9 and steps[-1].truncated.all()
    episode = steps[-1].info[0]["episode"]
    returns = sum(ts.reward[0] for ts in steps)
    np.testing.assert_allclose(episode["agent_r"], returns, rtol=1e-5)
    assert episode["l"] == 10 and episode["r"] == pytest.approx(sum(episode["agent_r"]))


def test_both_managers_give_the_same_mpe_trajectories_across_episode_ends(managers):
    runs = []
    for kind in ("sync", "subprocess"):
        envs = _build(managers, SPREAD, kind, seed=3)
        first = envs.reset()
        runs.append([first["obs"]] + [x for ts in map(envs.step, _actions(envs, 25)) for x in (ts.obs["obs"],
                                                                                              ts.reward)])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_simple_tag_pads_the_good_agents_shorter_observation_and_gives_the_envs_own_state(managers):
    from mpe2 import simple_tag_v3

    envs = _build(managers, {"env_id": "mpe/simple_tag_v3", "env_kwargs": {"max_cycles": 5}, "collector_env_num": 1})
    obs = envs.reset(seed=7)
    direct = simple_tag_v3.parallel_env(max_cycles=5)
    mine, _ = direct.reset(seed=7)
    assert envs.agent_spaces.obs_dim == 16 and envs.agent_spaces.state_dim == 62
    np.testing.assert_array_equal(obs["obs"][0, 3, :14], mine["agent_0"])
    assert not obs["obs"][0, 3, 14:].any()
    np.testing.assert_array_equal(obs["state"][0], direct.state())


def test_continuous_mpe_actions_are_a_box_row_per_agent_without_action_masks(managers):
    envs = _build(managers, {"env_id": "mpe/simple_reference_v3", "collector_env_num": 2,
                             "env_kwargs": {"continuous_actions": True, "max_cycles": 5}})
    obs = envs.reset()
    assert envs.action_space.shape == (2, 15) and "action_mask" not in obs
    assert envs.agent_spaces.action_space == spaces.Box(0.0, 1.0, (15,), np.float32)
    ts = envs.step(_actions(envs, 1)[0])
    assert ts.reward.shape == (2, 2) and ts.obs["obs"].shape == (2, 2, 21)


def test_max_episode_steps_truncates_a_team_episode(managers):
    envs = _build(managers, dict(SPREAD, max_episode_steps=3))
    envs.reset()
    steps = [envs.step(action) for action in _actions(envs, 3)]
    assert steps[-1].truncated.all() and steps[-1].info[0]["episode"]["l"] == 3 and not steps[1].done.any()


@pytest.mark.parametrize("cfg", [SPREAD, {"env_id": "vmas/navigation", "env_kwargs": {"max_steps": 6},
                                          "collector_env_num": 2}], ids=["mpe", "vmas"])
def test_a_restored_manager_goes_on_exactly_as_the_saved_one(managers, cfg):
    saved = _build(managers, cfg, "sync", seed=5)
    saved.reset()
    actions = _actions(saved, 16)
    for action in actions[:5]:
        saved.step(action)
    state = saved.state_dict()
    expected = [saved.step(action) for action in actions[5:]]
    restored = _build(managers, cfg, "subprocess", seed=99)
    result = restored.load_state_dict(state)
    assert result.reseeded == []
    for want, ts in zip(expected, map(restored.step, actions[5:])):
        np.testing.assert_array_equal(want.obs["obs"], ts.obs["obs"])
        np.testing.assert_array_equal(want.reward, ts.reward)


def test_a_vmas_env_draws_from_its_own_random_state_whatever_the_other_envs_do(managers):
    cfg = {"env_id": "vmas/navigation", "env_kwargs": {"max_steps": 4}}
    pair = _build(managers, dict(cfg, collector_env_num=2), seed=0)
    alone = _build(managers, dict(cfg, collector_env_num=1), seed=1)
    np.testing.assert_array_equal(pair.reset()["obs"][1], alone.reset()["obs"][0])
    for action in _actions(pair, 9):  # over two episode ends: the new worlds are drawn at random too
        np.testing.assert_array_equal(pair.step(action).obs["obs"][1], alone.step(action[1:]).obs["obs"][0])


def test_vmas_balance_with_discrete_actions_has_action_masks(managers):
    envs = _build(managers, {"env_id": "vmas/balance", "collector_env_num": 1,
                             "env_kwargs": {"continuous_actions": False, "max_steps": 3}})
    obs = envs.reset()
    team = envs.agent_spaces
    assert (team.agent_num, team.obs_dim, team.state_dim, team.action_space) == (3, 16, 48, spaces.Discrete(9))
    assert obs["action_mask"].shape == (1, 3, 9) and obs["action_mask"].all()
    steps = [envs.step(action) for action in _actions(envs, 3)]
    assert steps[-1].truncated[0] and len(steps[-1].info[0]["episode"]["agent_r"]) == 3


def test_an_unknown_scenario_names_the_closest_and_lists_the_accepted_ids():
    with pytest.raises(ConfigError, match=r"'mpe/simple_spred_v3', which is no mpe scenario: did you mean "
                                          r"'mpe/simple_spread_v3'\? accepted ids: .*mpe/simple_tag_v3") as info:
        make_env_manager(dict(SPREAD, env_id="mpe/simple_spred_v3"), "collector")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="no vmas scenario: .*vmas/navigation"):
        make_env_manager({"env_id": "vmas/navigate"}, "collector")


def test_a_missing_marl_package_is_named_with_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpe2", None)  # import mpe2 now raises ImportError
    with pytest.raises(ConfigError, match=r"env.env_id 'mpe/simple_spread_v3' needs the 'mpe2' package .*"
                                          r"pip install \"conveyor\[marl\]\""):
        make_env_manager(SPREAD, "collector")


def test_the_envpool_manager_refuses_a_multi_agent_id():
    with pytest.raises(ConfigError, match="env.manager 'envpool' has no multi-agent envs .* set env.manager to 'sync'"):
        make_env_manager(dict(SPREAD, manager="envpool"), "collector")


class _TeamPolicy:
    """The least compile_config needs of a team's policy class."""

    multi_agent = True

    @classmethod
    def config_schema(cls) -> dict:
        return {"model": {key: Option(None, key, type=int) for key in ("obs_shape", "action_shape", "state_shape",
                                                                        "n_agents")}}


def test_compile_config_gives_a_team_policy_its_model_sizes_and_refuses_a_single_agent_env():
    from conveyor.config import compile_config

    compiled = compile_config({"env": SPREAD, "policy": {}}, policy=_TeamPolicy)
    assert dict(compiled.policy.model) == {"obs_shape": 18, "action_shape": 5, "state_shape": 54, "n_agents": 3}
    with pytest.raises(ConfigError, match="_TeamPolicy trains a team of agents, but env.env_id='CartPole-v1'"):
        compile_config({"env": {"env_id": "CartPole-v1"}, "policy": {}}, policy=_TeamPolicy)


@pytest.mark.parametrize("env_id", ["mpe/simple_tag_v3", "vmas/navigation"])
def test_check_env_passes_a_teams_env(env_id):
    check_env(env_id, steps=12)


FORKED_VMAS = """
import numpy as np, torch
from conveyor.envs import make_env_manager
x = torch.randn(256, 4096)
x.min(dim=-1), x @ x.T  # parallel operators: this process now has OpenMP threads, which a fork does not copy
cfg = {"env_id": "vmas/navigation", "manager": "subprocess", "start_method": "fork", "collector_env_num": 2}
with make_env_manager(cfg, "collector", seed=0) as envs:
    envs.reset()
    envs.step(np.zeros((2, 4, 2), np.float32))
print("stepped")
"""


def test_vmas_runs_in_workers_forked_from_a_process_that_ran_parallel_torch_operators():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", FORKED_VMAS], start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(root)))
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        out = "no answer in 120 s (the workers hung)"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert out.strip().endswith("stepped"), out
