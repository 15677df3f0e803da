"""QMIX and VDN: the mixers, masked eps-greedy acting, the double-Q TD target, target networks, checkpoints."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor import OnlineRLContext
from conveyor.middleware import StepCollector
from conveyor.policy import QMixer, QMIXPolicy, VDNMixer
from conveyor.schema import ConfigError
from policy_testing import TeamMatching, greedy_reward, through_bytes

N_AGENTS, OBS, STATE, ACTIONS, T, B = 3, 4, 6, 5, 4, 6


def make(seed=0, learn=None, **model):
    return QMIXPolicy({"model": {"n_agents": N_AGENTS, "obs_shape": OBS, "state_shape": STATE, "action_shape": ACTIONS,
                                 "hidden_sizes": [16], "rnn_hidden_size": 8, "mixing_embed_dim": 8,
                                 "hypernet_hidden": 16, **model},
                       "learn": learn or {}}, seed=seed)


def sequences(seed=0, **overrides):
    """Episode sequences [T, B] with per-agent rewards; agent 2 leaves after step 1 of sequence 0; sequence 1's
    episode ends (terminated) at step 2, its last step is padding (mask False)."""
    g = torch.Generator().manual_seed(seed)
    alive = torch.ones(T, B, N_AGENTS, dtype=torch.bool)
    alive[2:, 0, 2] = False
    next_alive = torch.cat([alive[1:], alive[-1:]])
    mask = torch.ones(T, B, dtype=torch.bool)
    mask[3, 1] = False
    terminated = torch.zeros(T, B, dtype=torch.bool)
    terminated[2, 1] = True
    action_mask = torch.rand(T, B, N_AGENTS, ACTIONS, generator=g) < 0.7
    action_mask[..., 0] = True
    action = torch.where(action_mask, torch.rand(T, B, N_AGENTS, ACTIONS, generator=g), -1.0).argmax(-1)
    fields = {"obs": torch.randn(T, B, N_AGENTS, OBS, generator=g), "state": torch.randn(T, B, STATE, generator=g),
              "next_obs": torch.randn(T, B, N_AGENTS, OBS, generator=g),
              "next_state": torch.randn(T, B, STATE, generator=g), "action_mask": action_mask,
              "next_action_mask": torch.ones(T, B, N_AGENTS, ACTIONS, dtype=torch.bool), "agent_mask": alive,
              "next_agent_mask": next_alive, "action": action, "reward": torch.randn(T, B, N_AGENTS, generator=g),
              "terminated": terminated, "mask": mask}
    fields.update(overrides)
    return ttorch.Tensor(fields)


def observations(n_env, seed=0, action_mask=None):
    rng = np.random.default_rng(seed)
    obs = {"obs": rng.standard_normal((n_env, N_AGENTS, OBS)).astype(np.float32),
           "state": rng.standard_normal((n_env, STATE)).astype(np.float32)}
    if action_mask is not None:
        obs["action_mask"] = action_mask
    return obs


@pytest.mark.parametrize("seed", range(3))
def test_the_qmix_mixer_is_monotonic_in_every_agents_q(seed):
    torch.manual_seed(seed)
    mixer = QMixer(N_AGENTS, STATE, embed_dim=8, hypernet_hidden=16)
    q = (torch.randn(256, N_AGENTS) * 5).requires_grad_()
    q_tot = mixer(q, torch.randn(256, STATE) * 3)
    (grad,) = torch.autograd.grad(q_tot.sum(), q)  # row i's Q_tot depends on row i's q only
    assert q_tot.shape == (256,)
    assert (grad >= 0).all() and (grad > 0).any()


def test_vdn_is_the_sum_of_the_agents_q():
    q = torch.randn(T, B, N_AGENTS)
    torch.testing.assert_close(VDNMixer()(q, torch.randn(T, B, STATE)), q.sum(-1))


def test_masked_actions_are_never_chosen_greedily_or_exploring():
    allowed = np.random.default_rng(1).integers(0, ACTIONS, (128, N_AGENTS))
    obs = observations(128, action_mask=np.eye(ACTIONS, dtype=bool)[allowed])
    policy = make()
    for eps in (0.0, 1.0):
        np.testing.assert_array_equal(policy.collect_mode.forward(obs, eps=eps)["action"], allowed)
    np.testing.assert_array_equal(policy.eval_mode.forward(obs)["action"], allowed)
    two = obs["action_mask"].copy()
    two[..., 0] = True
    actions = policy.collect_mode.forward({**obs, "action_mask": two}, eps=1.0)["action"]
    assert np.all((actions == 0) | (actions == allowed)) and (actions[allowed != 0] != 0).any()


def test_the_agents_state_carries_over_steps_and_is_reset_per_env():
    policy = make()
    obs = observations(2)
    first = policy.eval_mode.forward(obs)["action"]
    for _ in range(5):
        policy.eval_mode.forward(obs)
    policy.eval_mode.reset([0])
    q_after_reset = policy.eval_mode._memory["hidden"]
    assert not q_after_reset[0].any() and q_after_reset[1].any()
    policy.eval_mode.reset()
    np.testing.assert_array_equal(policy.eval_mode.forward(obs)["action"], first)


@pytest.mark.parametrize("double", [True, False])
def test_the_td_target_takes_the_next_action_from_the_online_net_and_its_value_from_the_target_net(double):
    policy = make(learn={"double": double, "team_reward": "sum"})
    with torch.no_grad():
        for p in policy.model.parameters():  # online and target nets differ
            p.add_(torch.randn_like(p) * 0.3)
    batch = sequences()
    with torch.no_grad():
        _, hidden = policy.model.agents.unroll(batch.obs, None, None)
        _, target_hidden = policy.target_model.agents.unroll(batch.obs, None, None)
        next_target_q = policy.target_model.agents(batch.next_obs, target_hidden)[0]
        chooser = policy.model.agents(batch.next_obs, hidden)[0] if double else next_target_q
        next_q = next_target_q.gather(-1, chooser.argmax(-1, keepdim=True)).squeeze(-1)
        next_q_tot = policy.target_model.mixer(next_q * batch.next_agent_mask, batch.next_state)
        reward = (batch.reward * batch.agent_mask).sum(-1)
        target = reward + 0.99 * (~batch.terminated) * next_q_tot
    result = policy.learn_mode.forward(batch)
    assert result["charts/target_mean"] == pytest.approx(target[batch.mask].mean().item(), rel=1e-5)


def test_the_agents_state_restarts_after_each_episode_end_of_a_sequence():
    batch = sequences()
    batch.terminated[1, 3] = True
    explicit = sequences(terminated=batch.terminated)
    explicit.episode_start = torch.zeros(T, B, dtype=torch.bool)
    explicit.episode_start[2, 3] = explicit.episode_start[3, 1] = True
    results = []
    for given in (batch, explicit, sequences(terminated=batch.terminated, episode_start=torch.zeros(T, B).bool())):
        torch.manual_seed(0)
        results.append(make().learn_mode.forward(given).metrics)
    assert results[0] == results[1] != results[2]


def test_padded_steps_and_absent_agents_add_nothing_to_the_loss():
    results = []
    for garbage in (0.0, 1e4):
        torch.manual_seed(0)
        batch = sequences()
        batch.reward[3, 1] = garbage  # a padded step
        batch.reward[2:, 0, 2] = garbage  # an agent that left
        results.append(make().learn_mode.forward(batch).metrics)
    assert results[0] == results[1]


@pytest.mark.parametrize("mixer", ["qmix", "vdn"])
def test_the_td_loss_decreases_on_a_tiny_fixed_batch(mixer):
    policy = make(mixer=mixer, learn={"learning_rate": 1e-2, "target_update_freq": 1000})
    batch = sequences()
    losses = [policy.learn_mode.forward(batch)["losses/td"] for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_the_target_net_is_copied_every_target_update_freq_steps_or_follows_softly():
    policy = make(learn={"target_update_freq": 3})
    batch = sequences()
    initial = [p.clone() for p in policy.target_model.parameters()]
    for step in range(3):
        policy.learn_mode.forward(batch)
        same = all(torch.equal(t, s) for t, s in zip(policy.target_model.parameters(), policy.model.parameters()))
        assert same == (step == 2)
        if step < 2:
            assert all(torch.equal(t, i) for t, i in zip(policy.target_model.parameters(), initial))
    soft = make(learn={"target_theta": 0.1})
    before = [p.clone() for p in soft.target_model.parameters()]
    soft.learn_mode.forward(batch)
    for target, old, online in zip(soft.target_model.parameters(), before, soft.model.parameters()):
        torch.testing.assert_close(target, 0.9 * old + 0.1 * online)


def test_a_checkpoint_round_trip_gives_identical_actions_and_updates():
    policy = make()
    batch = sequences()
    for _ in range(2):
        policy.learn_mode.forward(batch)
    policy.publish()
    obs = observations(4)
    policy.collect_mode.forward(obs, eps=0.5)
    restored = make(seed=9)
    restored.load_state_dict(through_bytes(policy.state_dict()))
    restored.collect_mode.load_state_dict(through_bytes(policy.collect_mode.state_dict()))
    for _ in range(3):
        np.testing.assert_array_equal(policy.collect_mode.forward(obs, eps=0.5)["action"],
                                      restored.collect_mode.forward(obs, eps=0.5)["action"])
    assert policy.learn_mode.forward(batch).metrics == restored.learn_mode.forward(batch).metrics


def test_a_checkpoint_of_another_team_is_refused_in_one_line_saying_what_changed():
    saved = make().state_dict()
    with pytest.raises(ConfigError, match=r"n_agents 3 -> 2.*start a new run") as info:
        QMIXPolicy({"model": {"n_agents": 2, "obs_shape": OBS, "state_shape": STATE,
                              "action_shape": ACTIONS}}).load_state_dict(saved)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="mixer 'qmix' -> 'vdn'"):
        make(mixer="vdn").load_state_dict(saved)


@pytest.mark.parametrize("model, learn, message", [
    ({"mixer": "qmax"}, {}, "policy.model.mixer"),
    ({"state_shape": None}, {}, "mixer='vdn'"),
    ({"action_shape": 1}, {}, "policy.model.action_shape"),
    ({}, {"team_reward": "max"}, "policy.learn.team_reward"),
    ({}, {"target_theta": 2.0}, "policy.learn.target_theta"),
])
def test_bad_config_values_get_a_one_line_error_naming_the_key(model, learn, message):
    with pytest.raises(ConfigError, match=message) as info:
        make(learn=learn, **model)
    assert "\n" not in str(info.value)


def test_qmix_learns_from_the_collectors_team_trajectories():
    env = TeamMatching()
    policy = QMIXPolicy({"model": {"n_agents": env.agents, "obs_shape": env.actions, "action_shape": env.actions,
                                   "state_shape": env.agents * env.actions, "hidden_sizes": [32],
                                   "rnn_hidden_size": 16, "mixing_embed_dim": 8, "hypernet_hidden": 16},
                         "learn": {"learning_rate": 5e-3, "target_update_freq": 20},
                         "collect": {"n_sample": env.env_num * env.length}, "discount_factor": 0.5}, seed=0)
    cfg = EasyDict(seed=0, policy=policy.cfg)
    ctx = OnlineRLContext()
    ctx.collect_kwargs = {"eps": 0.3}
    collect = StepCollector(cfg, policy.collect_mode, env)
    before = greedy_reward(policy)
    for _ in range(40):
        collect(ctx)  # [T, N] chunks of whole episodes (T = the episode length): sequences from an episode start
        for _ in range(2):
            policy.learn_mode.forward(ctx.trajectories)  # as collected: real steps by valid
        policy.publish()
    assert before < 0.7 and greedy_reward(policy) > 0.9


def test_an_episode_truncated_by_its_time_limit_bootstraps_from_every_agent_that_took_the_last_step():
    # Every agent leaves at an episode's end (next_agent_mask all False), yet a truncated episode was cut short: its
    # last step's target is the one of a chunk end inside the episode, where the agents stay in next_obs.
    alive = sequences().agent_mask
    truncated = torch.zeros(T, B, dtype=torch.bool)
    truncated[T - 1, 2:] = True
    leaving = torch.cat([alive[1:], alive[-1:]])
    leaving[T - 1, 2:] = False
    targets = []
    for batch in (sequences(truncated=truncated, next_agent_mask=leaving), sequences(),
                  sequences(next_agent_mask=leaving)):
        torch.manual_seed(0)
        targets.append(make().learn_mode.forward(batch)["charts/target_mean"])
    assert targets[0] == pytest.approx(targets[1], rel=1e-6) and targets[0] != pytest.approx(targets[2], rel=1e-3)
