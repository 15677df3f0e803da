"""GAE over time-major trajectories: termination, truncation, chunk ends, invalid rows, recurrent sequences."""
import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor import OnlineRLContext
from conveyor.data import DequeBuffer
from conveyor.middleware import gae_estimator, generalized_advantage

GAMMA, LAMBDA = 0.5, 0.5


class ObsIsValue:
    """A critic whose value of an observation is the observation itself; records what it was asked."""

    def __init__(self):
        self.calls = []

    def value(self, obs, **state):
        self.calls.append((np.asarray(obs).copy(), {k: np.asarray(v).copy() for k, v in state.items()}))
        return np.asarray(obs, dtype=np.float32).copy()


def config(sequence_length=None):
    return EasyDict(policy=dict(discount_factor=GAMMA, gae_lambda=LAMBDA, learn=dict(sequence_length=sequence_length)))


def trajectory(**fields):
    """A [T, N] batch from nested lists; ``obs``/``next_obs``/``value`` are the scalar values the fake critic reads."""
    out = {}
    for key, value in fields.items():
        dtype = torch.bool if key in ("terminated", "truncated", "valid") else torch.float32
        out[key] = torch.tensor(value, dtype=dtype)
    return ttorch.Tensor(out)


def hand_case(**extra):
    """Env 0: a step, a termination (its final observation 100 must be ignored), a step cut by the chunk end.
    Env 1: a truncation (bootstraps from its final observation 10), a crashed row, a step cut by the chunk end."""
    return trajectory(
        obs=[[1.0, 1.0], [2.0, 50.0], [3.0, 2.0]],
        value=[[1.0, 1.0], [2.0, 50.0], [3.0, 2.0]],
        reward=[[1.0, 2.0], [1.0, 7.0], [1.0, 0.0]],
        next_obs=[[2.0, 10.0], [100.0, 2.0], [4.0, 6.0]],
        terminated=[[False, False], [True, False], [False, False]],
        truncated=[[False, True], [False, False], [False, False]],
        valid=[[True, True], [True, False], [True, True]],
        action=[[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]],
        **extra,
    )


def run(traj, critic=None, cfg=None, buffer=None):
    ctx = OnlineRLContext()
    ctx.trajectories = traj
    gae_estimator(cfg or config(), critic or ObsIsValue(), buffer)(ctx)
    return ctx


def test_gae_matches_a_hand_computed_case_with_termination_truncation_chunk_end_and_a_crashed_row():
    # env 0: t2 delta = 1 + .5*4 - 3 = 0;  t1 (terminated) delta = 1 - 2 = -1;  t0 = (1 + .5*2 - 1) + .25*(-1) = .75
    # env 1: t2 delta = 0 + .5*6 - 2 = 1;  t1 crashed (dropped);  t0 (truncated) delta = 2 + .5*10 - 1 = 6
    data = run(hand_case()).train_data
    np.testing.assert_allclose(data.adv.numpy(), [0.75, 6.0, -1.0, 0.0, 1.0])  # valid rows, time-major order
    np.testing.assert_allclose(data["return"].numpy(), [1.75, 7.0, 1.0, 3.0, 3.0])
    np.testing.assert_allclose(data.action.numpy(), [0.0, 1.0, 1.0, 0.0, 1.0])


def test_the_critic_is_asked_only_for_truncated_and_chunk_end_next_observations():
    critic = ObsIsValue()
    run(hand_case(), critic)
    assert len(critic.calls) == 1  # one batched call
    np.testing.assert_allclose(np.sort(critic.calls[0][0]), [4.0, 6.0, 10.0])


def test_output_is_flat_without_invalid_rows_or_next_obs():
    data = run(hand_case()).train_data
    assert tuple(data.adv.shape) == (5,)
    assert "next_obs" not in data and "valid" not in data
    assert {"obs", "action", "value", "reward", "adv", "return"} <= set(data.keys())


def test_values_are_computed_when_the_trajectory_has_none():
    traj = hand_case()
    del traj["value"]
    np.testing.assert_allclose(run(traj).train_data.adv.numpy(), [0.75, 6.0, -1.0, 0.0, 1.0])


def test_with_a_buffer_the_batch_is_pushed_instead():
    buffer = DequeBuffer(16)
    ctx = run(hand_case(), buffer=buffer)
    assert ctx.train_data is None and len(buffer) == 5
    assert "adv" in buffer.sample(2) and "return" in buffer.sample(2)


def test_episodes_end_to_end_are_one_time_axis():
    traj = trajectory(obs=[1.0, 2.0, 3.0], value=[1.0, 2.0, 3.0], reward=[1.0, 1.0, 1.0], next_obs=[2.0, 100.0, 8.0],
                      terminated=[False, True, False], truncated=[False, False, True])
    # episode 1: t1 delta = 1 - 2 = -1, t0 = (1 + .5*2 - 1) + .25*(-1) = .75;  episode 2 (truncated): 1 + .5*8 - 3 = 2
    np.testing.assert_allclose(run(traj).train_data.adv.numpy(), [0.75, -1.0, 2.0])


def test_lambda_one_gives_discounted_returns_and_lambda_zero_td_errors():
    reward = np.array([[1.0], [2.0], [3.0]], np.float32)
    value = np.array([[0.5], [1.0], [1.5]], np.float32)
    next_value = np.array([[1.0], [1.5], [2.0]], np.float32)
    done = np.zeros((3, 1), bool)
    mc = generalized_advantage(reward, value, next_value, done, 0.9, 1.0)
    returns = [1 + 0.9 * 2 + 0.81 * 3 + 0.729 * 2.0, 2 + 0.9 * 3 + 0.81 * 2.0, 3 + 0.9 * 2.0]
    np.testing.assert_allclose(mc[:, 0], np.array(returns) - value[:, 0], rtol=1e-6)
    td = generalized_advantage(reward, value, next_value, done, 0.9, 0.0)
    np.testing.assert_allclose(td, reward + 0.9 * next_value - value, rtol=1e-6)


# --- recurrent trajectories: sequences ----------------------------------------------------------------
def recurrent_case():
    """T = 5 steps of N = 1 env; the episode ends (terminated) at t = 1; hidden states are the step number."""
    hidden = [[[float(t)]] for t in range(5)]
    next_hidden = [[[float(t) + 0.5]] for t in range(5)]
    return trajectory(
        obs=[[1.0], [2.0], [3.0], [4.0], [5.0]], value=[[1.0], [2.0], [3.0], [4.0], [5.0]],
        reward=[[0.0]] * 5, next_obs=[[2.0], [9.0], [4.0], [5.0], [6.0]],
        terminated=[[False], [True], [False], [False], [False]], truncated=[[False]] * 5, valid=[[True]] * 5,
        action=[[0.0]] * 5, hidden=hidden, next_hidden=next_hidden,
    )


def test_recurrent_trajectories_become_padded_sequences_with_episode_starts_and_a_mask():
    data = run(recurrent_case(), cfg=config(sequence_length=2)).train_data
    assert tuple(data.adv.shape) == (2, 3)  # [L = 2, 3 sequences]: steps (0, 1), (2, 3), (4, pad)
    np.testing.assert_array_equal(data.obs.numpy(), [[1.0, 3.0, 5.0], [2.0, 4.0, 0.0]])
    np.testing.assert_array_equal(data.mask.numpy(), [[True, True, True], [True, True, False]])
    np.testing.assert_array_equal(data.episode_start.numpy(), [[False, True, False], [False, False, False]])
    np.testing.assert_array_equal(data.hidden[0, :, 0].numpy(), [0.0, 2.0, 4.0])  # each sequence's first state


def test_recurrent_bootstrap_passes_the_state_after_the_last_step():
    critic = ObsIsValue()
    run(recurrent_case(), critic, cfg=config(sequence_length=2))
    obs, state = critic.calls[0]
    np.testing.assert_allclose(obs, [6.0])
    np.testing.assert_allclose(state["hidden"], [[4.5]])


def test_recurrent_trajectories_cannot_go_to_a_buffer():
    with pytest.raises(ValueError, match="buffer"):
        run(recurrent_case(), cfg=config(sequence_length=2), buffer=DequeBuffer(8))


def test_a_policy_view_without_a_critic_is_refused_up_front():
    class NoCritic:
        def forward(self, obs):
            return {}

    with pytest.raises(TypeError, match="value"):
        gae_estimator(config(), NoCritic())


# A team (MAPPO): env axis N = 1, agents A = 2, gamma = lambda = 0.5. Agent 1 leaves after step 0 (its value 9 at
# step 1 is a dead agent's, never to be read) and is back in the episode that starts at step 2; the episode ends
# (terminated) after step 1; step 2 is cut by the chunk end, bootstrapping from 4 (agent 0) and 8 (agent 1).
TEAM_VALUE = [[[0.5, 1.0]], [[1.0, 9.0]], [[2.0, 3.0]]]
TEAM_REWARD = [[[1.0, 4.0]], [[2.0, 5.0]], [[3.0, 6.0]]]
TEAM_ALIVE = [[[True, True]], [[True, False]], [[True, True]]]
# By hand: agent 0: delta = (1 + .5 * 1 - .5, 2 + 0 - 1, 3 + .5 * 4 - 2) = (1, 1, 3); adv = (1 + .25 * 1, 1, 3).
# Agent 1: it left after step 0, so no bootstrap there: delta0 = 4 + 0 - 1 = 3; step 1 counts for nothing;
# delta2 = 6 + .5 * 8 - 3 = 7.
TEAM_ADV = [[[1.25, 3.0]], [[1.0, 0.0]], [[3.0, 7.0]]]


def test_masked_gae_matches_a_hand_computed_team_case_with_a_dead_agent_and_an_env_done():
    value = np.array(TEAM_VALUE, np.float32)
    next_value = np.array([[[1.0, 9.0]], [[0.0, 0.0]], [[4.0, 8.0]]], np.float32)  # value[t + 1] as a caller reads it
    done = np.array([[False], [True], [False]])  # per env [T, N]: broadcast over the agents
    adv = generalized_advantage(np.array(TEAM_REWARD, np.float32), value, next_value, done, GAMMA, LAMBDA,
                                mask=np.array(TEAM_ALIVE))
    np.testing.assert_allclose(adv, TEAM_ADV)
    assert adv.dtype == np.float32


def test_gae_estimator_follows_the_agent_axis_and_the_agent_mask():
    traj = trajectory(obs=TEAM_VALUE, value=TEAM_VALUE, reward=TEAM_REWARD,
                      next_obs=[[[1.0, 9.0]], [[100.0, 100.0]], [[4.0, 8.0]]],
                      terminated=[[False], [True], [False]], truncated=[[False], [False], [False]])
    traj.agent_mask = torch.tensor(TEAM_ALIVE)
    data = run(traj).train_data
    np.testing.assert_allclose(data.adv.numpy(), np.array(TEAM_ADV).reshape(3, 2))
    np.testing.assert_allclose(data["return"].numpy(), (np.array(TEAM_ADV) + np.array(TEAM_VALUE)).reshape(3, 2))


class TeamObsIsValue:
    """A team critic over an observation mapping, as MAPPO's: each agent's value is its ``obs``, 0 for an agent
    absent from it (``agent_mask`` False)."""

    def value(self, obs, **state):
        return (obs["obs"] * obs["agent_mask"]).numpy()


def team_mapping(values, alive):
    return ttorch.Tensor({"obs": torch.tensor(values), "agent_mask": torch.tensor(alive)})


def test_a_team_truncated_by_its_time_limit_bootstraps_every_agent_that_took_the_last_step():
    # gamma = lambda = .5, 2 envs x 2 agents, rewards 1. Env 0's episode is truncated after step 1: every agent
    # leaves (agent mask False in the final observation), yet each bootstraps from its final observation (4, 8).
    # Env 1 is cut by the chunk end after step 1, agent 1 having left the episode: it bootstraps from 0.
    # env 0: agent 0 delta = (1 + .5 * 3 - 1, 1 + .5 * 4 - 3) = (1.5, 0); agent 1: (1 + .5 * 4 - 2, 1 + .5 * 8 - 4)
    # env 1: agent 0: (1 + .5 * 2 - 1, 1 + .5 * 6 - 2) = (1, 2); agent 1: (1, 1 + 0 - 2) = (1, -1)
    obs = [[[1.0, 2.0], [1.0, 1.0]], [[3.0, 4.0], [2.0, 2.0]]]
    everyone = [[[True, True], [True, True]], [[True, True], [True, True]]]
    traj = ttorch.Tensor({
        "obs": team_mapping(obs, everyone), "value": torch.tensor(obs), "reward": torch.ones(2, 2, 2),
        "next_obs": team_mapping([[[3.0, 4.0], [2.0, 2.0]], [[4.0, 8.0], [6.0, 6.0]]],
                                 [[[True, True], [True, True]], [[False, False], [True, False]]]),
        "terminated": torch.zeros(2, 2, dtype=torch.bool), "truncated": torch.tensor([[False, False], [True, False]])})
    data = run(traj, TeamObsIsValue()).train_data
    np.testing.assert_allclose(data.adv.numpy(), [[1.5, 1.25], [1.5, 0.75], [0.0, 1.0], [2.0, -1.0]])
