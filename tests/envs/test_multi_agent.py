"""MultiAgentEnv through the env managers, on a small Parallel API env of this file (no marl packages needed):
the agent axis, padding, masks, agents that leave, the global state, rewards and returns per agent and team."""
from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

from conveyor.envs import AgentSpaces, MultiAgentEnv, SyncEnvManager, agent_spaces, check_env, make_env_manager, \
    require_multi_agent, require_single_agent
from conveyor.schema import ConfigError


class Trio:
    """A Parallel API env of three agents: ``a`` (obs 3, 4 actions, mask in its obs dict), ``b`` (obs 2, 2 actions,
    mask in its info) and ``c`` (obs 3, 4 actions, no mask). ``b`` leaves (terminated) after ``b_steps`` steps;
    ``a`` and ``c`` are truncated after ``steps``. Observations count the steps; the reward is the action + 1.
    Stepping an agent that has left raises, as a strict env would."""

    possible_agents = ["a", "b", "c"]

    def __init__(self, steps: int = 4, b_steps: int = 2) -> None:
        self.steps, self.b_steps = steps, b_steps
        self.agents: list[str] = []
        self.t = 0
        self.seen: list[dict] = []

    def observation_space(self, agent: str) -> spaces.Space:
        if agent == "a":
            return spaces.Dict({"observation": spaces.Box(-9, 9, (3,)), "action_mask": spaces.MultiBinary(4)})
        return spaces.Box(-9, 9, (2,) if agent == "b" else (3,))

    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(2 if agent == "b" else 4)

    def _obs(self) -> dict:
        t = float(self.t)
        return {"a": {"observation": np.full(3, t + 0.1), "action_mask": np.array([1, 0, 1, 0], np.int8)},
                "b": np.full(2, t + 0.2), "c": np.full(3, t + 0.3)}

    def _infos(self) -> dict:
        return {agent: ({"action_mask": np.array([0, 1], np.int8)} if agent == "b" else {}) for agent in self.agents}

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.t = 0
        self.agents = list(self.possible_agents)
        return self._obs(), self._infos()

    def step(self, actions: dict) -> tuple:
        if set(actions) != set(self.agents):
            raise RuntimeError(f"actions for {sorted(actions)} but the agents are {self.agents}")
        self.seen.append(dict(actions))
        self.t += 1
        rewards = {agent: float(action) + 1 for agent, action in actions.items()}
        terms = {agent: agent == "b" and self.t >= self.b_steps for agent in self.agents}
        truncs = {agent: agent != "b" and self.t >= self.steps for agent in self.agents}
        obs = {agent: value for agent, value in self._obs().items() if agent in self.agents}
        self.agents = [agent for agent in self.agents if not (terms[agent] or truncs[agent])]
        return obs, rewards, terms, truncs, self._infos()

    def close(self) -> None:
        pass


def _trio_manager(managers, **kwargs) -> SyncEnvManager:
    return managers("sync", [lambda: MultiAgentEnv(Trio(**kwargs), "trio")])


def test_values_have_a_fixed_agent_axis_in_possible_agents_order_with_observations_zero_padded(managers):
    envs = _trio_manager(managers)
    obs = envs.reset(seed=0)
    assert obs["obs"].shape == (1, 3, 3) and obs["obs"].dtype == np.float32
    np.testing.assert_allclose(obs["obs"][0], [[0.1] * 3, [0.2, 0.2, 0], [0.3] * 3], rtol=1e-6)
    assert obs["state"].shape == (1, 8)  # no state(): the agents' own observations concatenated (3 + 2 + 3)
    np.testing.assert_allclose(obs["state"][0], [0.1] * 3 + [0.2] * 2 + [0.3] * 3, rtol=1e-6)
    assert obs["agent_mask"].dtype == np.bool_ and obs["agent_mask"].tolist() == [[True, True, True]]
    assert envs.agent_spaces == AgentSpaces(agent_num=3, obs_dim=3, state_dim=8, action_space=spaces.Discrete(4))
    assert envs.reward_shape == (3,)


def test_action_masks_come_from_the_obs_dict_or_the_info_else_all_of_an_agents_actions(managers):
    envs = _trio_manager(managers)
    mask = envs.reset(seed=0)["action_mask"]
    assert mask.dtype == np.bool_
    assert mask[0].tolist() == [[True, False, True, False],  # a: its obs dict
                                [False, True, False, False],  # b: its info, False past its 2 actions
                                [True, True, True, True]]  # c: none given


def test_an_agent_that_leaves_is_masked_gets_zero_obs_and_its_actions_are_not_passed_on(managers):
    trio = Trio(steps=4, b_steps=2)
    envs = managers("sync", [lambda: MultiAgentEnv(trio, "trio")])
    envs.reset(seed=0)
    steps = [envs.step(np.array([[1, 1, 3]])) for _ in range(3)]
    leaving, after = steps[1], steps[2]
    assert leaving.next_obs["agent_mask"][0].tolist() == [True, False, True]
    np.testing.assert_allclose(leaving.next_obs["obs"][0, 1], [2.2, 2.2, 0], rtol=1e-6)  # its last observation
    assert leaving.next_obs["action_mask"][0, 1].tolist() == [False] * 4
    assert after.obs["obs"][0, 1].tolist() == [0, 0, 0] and after.obs["state"][0, 3:5].tolist() == [0, 0]
    assert after.reward[0].tolist() == [2, 0, 4]  # nothing for an agent that has left
    assert trio.seen[2] == {"a": 1, "c": 3}  # Trio raises on an action for b: none was passed
    assert not after.done[0]


def test_the_episode_ends_when_every_agent_has_left_with_team_and_per_agent_returns(managers):
    envs = _trio_manager(managers, steps=3, b_steps=1)
    envs.reset(seed=0)
    steps = [envs.step(np.array([[0, 1, 2]])) for _ in range(3)]
    assert [bool(ts.done[0]) for ts in steps] == [False, False, True]
    end = steps[-1]
    assert end.truncated[0] and not end.terminated[0]  # a and c were still in and were truncated
    assert end.reward.shape == (1, 3) and end.reward.dtype == np.float32
    assert end.info[0]["episode"] == {"r": 3 * 1 + 2 + 3 * 3, "l": 3, "agent_r": [3.0, 2.0, 9.0]}
    assert end.obs["agent_mask"][0].all() and not end.next_obs["agent_mask"][0].any()


def test_an_episode_whose_last_agents_terminate_is_terminated(managers):
    class Duo(Trio):
        possible_agents = ["b"]

    envs = managers("sync", [lambda: MultiAgentEnv(Duo(b_steps=2), "duo")])
    envs.reset(seed=0)
    steps = [envs.step(np.array([[0]])) for _ in range(2)]
    assert steps[1].terminated[0] and not steps[1].truncated[0]


def test_agent_spaces_refuses_a_single_agent_envs_spaces(managers):
    envs = make_env_manager({"env_id": "CartPole-v1", "collector_env_num": 1}, "collector")
    managers.track(envs)
    with pytest.raises(ValueError, match="no agent axis.*multi-agent id"):
        envs.agent_spaces


def test_agent_spaces_of_continuous_actions_cover_every_agents_bounds():
    observation = spaces.Dict({"obs": spaces.Box(-1, 1, (2, 4)), "state": spaces.Box(-1, 1, (8,)),
                               "agent_mask": spaces.Box(0, 1, (2,), np.bool_)})
    action = spaces.Box(np.array([[-1, -1, 0], [-2, 0, 0]], np.float32), np.array([[1, 1, 0], [2, 0, 0]], np.float32))
    team = agent_spaces(observation, action)
    assert (team.agent_num, team.obs_dim, team.state_dim, team.action_dim, team.discrete) == (2, 4, 8, 3, False)
    assert team.action_space.low.tolist() == [-2, -1, 0] and team.action_space.high.tolist() == [2, 1, 0]


@pytest.mark.parametrize("env_id", ["mpe/simple_spread_v3", "vmas/navigation"])
def test_a_single_agent_entry_refuses_a_multi_agent_env_id_in_one_line(env_id):
    with pytest.raises(ConfigError, match=r"DQNPolicy trains one agent, but env.env_id=.* is a multi-agent env: use a "
                                          r"multi-agent entry") as info:
        require_single_agent({"env_id": env_id}, "DQNPolicy")
    assert "\n" not in str(info.value)
    require_multi_agent({"env_id": env_id}, "MAPPOPolicy")


def test_a_multi_agent_entry_refuses_a_gymnasium_env_id_in_one_line():
    with pytest.raises(ConfigError, match=r"mpe/mappo trains a team of agents, but env.env_id='CartPole-v1' is a "
                                          r"single-agent Gymnasium env: set env.env_id to a multi-agent id \(mpe/"):
        require_multi_agent({"env_id": "CartPole-v1"}, "mpe/mappo")
    require_single_agent({"env_id": "CartPole-v1"}, "DQNPolicy")


def test_compile_config_refuses_a_multi_agent_env_for_a_single_agent_policy():
    from conveyor.config import compile_config
    from conveyor.policy import DQNPolicy

    with pytest.raises(ConfigError, match="DQNPolicy trains one agent, but env.env_id='mpe/simple_spread_v3'"):
        compile_config({"env": {"env_id": "mpe/simple_spread_v3"}, "policy": {}}, policy=DQNPolicy)


def test_check_env_passes_a_team_env_with_an_agent_that_leaves():
    check_env(lambda: MultiAgentEnv(Trio(steps=5, b_steps=2), "trio"), steps=12)
