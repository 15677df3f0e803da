"""MAPPO and IPPO: team networks, masked actions, value normalisation, the masked PPO loss, checkpoints."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor import OnlineRLContext
from conveyor.envs import make_env_manager
from conveyor.middleware import StepCollector, gae_estimator, multistep_trainer
from conveyor.policy import AgentNet, IPPOPolicy, MAPPOPolicy
from conveyor.policy.marl_model import MaskedCategoricalDist, masked_logits
from conveyor.schema import ConfigError
from policy_testing import TeamMatching, through_bytes

N_AGENTS, OBS, STATE, ACTIONS, HIDDEN = 3, 4, 6, 5, 8


def make(cls=MAPPOPolicy, seed=0, learn=None, **model):
    return cls({"model": {"n_agents": N_AGENTS, "obs_shape": OBS, "state_shape": STATE, "action_shape": ACTIONS,
                          "hidden_sizes": [16], "rnn_hidden_size": HIDDEN, **model}, "learn": learn or {}}, seed=seed)


def observations(n_env=2, seed=0, action_mask=None, agent_mask=None):
    rng = np.random.default_rng(seed)
    obs = {"obs": rng.standard_normal((n_env, N_AGENTS, OBS)).astype(np.float32),
           "state": rng.standard_normal((n_env, STATE)).astype(np.float32)}
    if action_mask is not None:
        obs["action_mask"] = action_mask
    if agent_mask is not None:
        obs["agent_mask"] = agent_mask
    return obs


def one_allowed_action(n_env, seed):
    """A mask allowing one random action per agent, and that action."""
    allowed = np.random.default_rng(seed).integers(0, ACTIONS, (n_env, N_AGENTS))
    return np.eye(ACTIONS, dtype=bool)[allowed], allowed


def fixed_batch(policy, n=16, seed=1, dead_value=0.0):
    """A flat team batch [n, A] collected by ``policy``, agent 2 gone in half the rows, with random advantages and
    returns the centralized critic can learn."""
    alive = np.ones((n, N_AGENTS), bool)
    alive[::2, 2] = False
    obs = observations(n, seed, agent_mask=alive)
    out = policy.collect_mode.forward(obs)
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(n, N_AGENTS, generator=g)
    ret = 3 * torch.from_numpy(obs["state"][:, :1]) + torch.arange(N_AGENTS) + 2  # a function of state and agent
    dead = torch.from_numpy(~alive)
    return ttorch.Tensor({**{k: torch.from_numpy(v) for k, v in obs.items()},
                          "action": torch.from_numpy(out["action"]), "logp": torch.from_numpy(out["logp"]),
                          "value": torch.from_numpy(out["value"]),
                          "adv": adv.masked_fill(dead, dead_value), "return": ret.masked_fill(dead, dead_value)})


def test_the_centralized_critic_reads_the_state_and_the_decentralized_one_the_agents_obs():
    mappo, ippo = make(), make(IPPOPolicy)
    assert (mappo.cfg.model.critic, ippo.cfg.model.critic) == ("centralized", "decentralized")
    obs = observations()
    other_state = {**obs, "state": obs["state"] + 1.0}
    other_obs = {**obs, "obs": obs["obs"] + 1.0}
    base = [p.collect_mode.value(obs) for p in (mappo, ippo)]
    assert not np.allclose(mappo.collect_mode.value(other_state), base[0])
    np.testing.assert_array_equal(mappo.collect_mode.value(other_obs), base[0])
    np.testing.assert_array_equal(ippo.collect_mode.value(other_state), base[1])
    assert not np.allclose(ippo.collect_mode.value(other_obs), base[1])


def test_centralized_values_are_one_per_agent_and_tell_agents_apart_by_id():
    policy = make()
    value = policy.collect_mode.value(observations(n_env=7))
    assert value.shape == (7, N_AGENTS)
    assert len({round(float(v), 6) for v in value[0]}) == N_AGENTS  # one state, three agent ids, three values
    state = torch.randn(7, STATE)
    assert policy.model.critic_input(torch.randn(7, N_AGENTS, OBS), state).shape == (7, N_AGENTS, STATE)


def test_collect_outputs_have_an_agent_axis_and_absent_agents_have_no_value():
    policy = make(rnn="gru")
    alive = np.array([[True, True, False], [True, True, True]])
    out = policy.collect_mode.forward(observations(agent_mask=alive))
    assert out["action"].shape == out["logp"].shape == out["value"].shape == (2, N_AGENTS)
    assert out["hidden"].shape == out["next_hidden"].shape == (2, N_AGENTS, 2 * HIDDEN)
    assert out["value"][0, 2] == 0.0 and out["value"][1, 2] != 0.0


def test_masked_actions_are_never_sampled_nor_chosen():
    mask, allowed = one_allowed_action(256, seed=3)
    obs = observations(256, action_mask=mask)
    policy = make()
    for _ in range(3):
        np.testing.assert_array_equal(policy.collect_mode.forward(obs)["action"], allowed)
    np.testing.assert_array_equal(policy.eval_mode.forward(obs)["action"], allowed)
    two = mask.copy()
    two[..., 0] = True  # two allowed actions: both get sampled, nothing else
    actions = policy.collect_mode.forward({**obs, "action_mask": two})["action"]
    assert np.all((actions == 0) | (actions == allowed))
    assert (actions == 0).any() and (actions[allowed != 0] != 0).any()


def test_the_entropy_is_over_the_allowed_actions_only():
    mask = torch.tensor([[True, True, False, False, False], [True] * 5, [False] * 5])
    _, entropy = MaskedCategoricalDist().log_prob_entropy(masked_logits(torch.zeros(3, 5), mask),
                                                          torch.zeros(3, dtype=torch.long))
    np.testing.assert_allclose(entropy.numpy(), [np.log(2), np.log(5), np.log(5)], rtol=1e-6)


def test_losses_decrease_on_a_tiny_fixed_batch():
    policy = make(learn={"learning_rate": 0.01})
    batch = fixed_batch(policy)
    first = policy.learn_mode.forward(batch)
    for _ in range(30):
        last = policy.learn_mode.forward(batch)
    assert abs(first["losses/policy"]) < 1e-6  # ratio 1 on normalised advantages
    assert last["losses/policy"] < -0.02  # clipping bounds the gain at about clip_ratio * mean |adv| / 2
    assert last["losses/value"] < 0.5 * first["losses/value"]


def test_absent_agents_add_nothing_to_the_loss():
    results = []
    for dead_value in (0.0, 1e4):
        torch.manual_seed(0)  # the same initial weights
        policy = make()
        results.append(policy.learn_mode.forward(fixed_batch(policy, dead_value=dead_value)).metrics)
    assert results[0] == results[1]


def test_value_normalisation_learns_returns_in_their_running_units():
    policy = make(learn={"learning_rate": 0.01})
    batch = fixed_batch(policy)
    batch["return"] = batch["return"] * 100 + 1000
    policy.learn_mode.gather(batch)
    alive = batch.agent_mask
    assert policy.value_stats.count == int(alive.sum())
    np.testing.assert_allclose(policy.value_stats.mean, batch["return"][alive].double().mean().item(), rtol=1e-6)
    for _ in range(60):
        policy.learn_mode.forward(batch)
    policy.publish()
    value = policy.collect_mode.value({k: batch[k].numpy() for k in ("obs", "state", "agent_mask")})
    returns = batch["return"][alive].numpy()
    error = np.abs(value[alive.numpy()] - returns).mean()
    assert error < 0.5 * returns.std()  # in reward units (~1400 +- 300): the critic's scaled values scaled back


def test_a_recurrent_policy_replays_what_it_acted_on_and_resets_the_state_of_ended_episodes():
    policy = make(rnn="gru")
    steps, n_env = 5, 2
    rows = [policy.collect_mode.forward(observations(n_env, seed=t)) | observations(n_env, seed=t)
            for t in range(steps)]
    policy.collect_mode.reset([0])
    after = policy.collect_mode.forward(observations(n_env, seed=9))
    assert not after["hidden"][0].any() and after["hidden"][1].any()
    seq = {key: torch.from_numpy(np.stack([row[key] for row in rows])) for key in
           ("obs", "state", "action", "logp", "value", "hidden")}
    seq.update(adv=torch.ones(steps, n_env, N_AGENTS), episode_start=torch.zeros(steps, n_env, dtype=torch.bool),
               mask=torch.ones(steps, n_env, dtype=torch.bool))
    seq["return"] = seq["value"]
    seq["episode_start"][0] = True
    result = policy.learn_mode.forward(ttorch.Tensor(seq))
    assert result["charts/approx_kl"] == pytest.approx(0.0, abs=1e-6) and result["charts/clip_frac"] == 0.0


def test_gaussian_actions_have_a_dim_per_agent_and_are_scored_from_the_raw_sample():
    policy = make(action_space="gaussian", action_shape=2, action_low=-1.0, action_high=1.0)
    out = policy.collect_mode.forward(observations(4))
    assert out["action"].shape == out["raw_action"].shape == (4, N_AGENTS, 2)
    assert np.abs(out["action"]).max() <= 1.0
    batch = ttorch.Tensor({**{k: torch.from_numpy(v) for k, v in observations(4).items()},
                           **{k: torch.from_numpy(out[k]) for k in ("action", "raw_action", "logp", "value")},
                           "adv": torch.ones(4, N_AGENTS), "return": torch.zeros(4, N_AGENTS)})
    assert policy.learn_mode.forward(batch)["charts/approx_kl"] == pytest.approx(0.0, abs=1e-6)


def test_shared_networks_tell_agents_apart_by_id_and_separate_ones_by_weights():
    x = torch.ones(2, N_AGENTS, OBS)
    no_id = AgentNet(N_AGENTS, OBS, 3, agent_id=False)(x)[0]
    torch.testing.assert_close(no_id[:, 0], no_id[:, 1])
    for net in (AgentNet(N_AGENTS, OBS, 3), AgentNet(N_AGENTS, OBS, 3, share=False)):
        out = net(x)[0]
        assert out.shape == (2, N_AGENTS, 3) and not torch.allclose(out[:, 0], out[:, 1])
    assert len(AgentNet(N_AGENTS, OBS, 3, share=False).cores) == N_AGENTS


def test_a_checkpoint_round_trip_gives_identical_outputs_and_exploration():
    policy = make(rnn="gru", learn={"value_clip": 0.2})
    batch = fixed_batch(make(), n=4).unsqueeze(0)  # sequences of one step [1, 4]
    batch.hidden = torch.zeros(1, 4, N_AGENTS, 2 * HIDDEN)
    batch.episode_start = batch.mask = torch.ones(1, 4, dtype=torch.bool)
    policy.learn_mode.gather(batch)
    policy.learn_mode.forward(batch)
    policy.publish()
    policy.collect_mode.forward(observations())  # a hidden state per env and agent, and draws from the generator
    restored = make(seed=5, rnn="gru", learn={"value_clip": 0.2})
    restored.load_state_dict(through_bytes(policy.state_dict()))
    restored.collect_mode.load_state_dict(through_bytes(policy.collect_mode.state_dict()))  # what collectors save
    assert restored.value_stats.count == policy.value_stats.count > 0
    obs = observations(seed=4)
    a, b = policy.collect_mode.forward(obs), restored.collect_mode.forward(obs)
    for key in ("action", "logp", "value", "hidden", "next_hidden"):
        np.testing.assert_array_equal(a[key], b[key])
    torch.testing.assert_close(policy.optimizer.state_dict(), restored.optimizer.state_dict())


def test_a_checkpoint_of_another_team_is_refused_in_one_line_saying_what_changed():
    saved = make().state_dict()
    with pytest.raises(ConfigError, match=r"n_agents 3 -> 4.*policy.model.n_agents.*start a new run") as info:
        MAPPOPolicy({"model": {"n_agents": 4, "obs_shape": OBS, "state_shape": STATE, "action_shape": ACTIONS,
                               "hidden_sizes": [16]}}).load_state_dict(saved)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="obs_shape 4 -> 7"):
        make(obs_shape=7).load_state_dict(saved)


@pytest.mark.parametrize("model, message", [
    ({"n_agents": 0}, "policy.model.n_agents"),
    ({"critic": "central"}, "policy.model.critic"),
    ({"obs_shape": [3, 4]}, "policy.model.obs_shape"),
    ({"state_shape": None}, "state_shape=54"),
])
def test_bad_config_values_get_a_one_line_error_naming_the_key(model, message):
    with pytest.raises(ConfigError, match=message) as info:
        make(**model)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("rnn", [None, "gru"])
def test_mappo_learns_through_the_collector_the_gae_estimator_and_the_trainer(rnn):
    env = TeamMatching()
    policy = MAPPOPolicy({"model": {"n_agents": env.agents, "obs_shape": env.actions, "action_shape": env.actions,
                                    "state_shape": env.agents * env.actions, "hidden_sizes": [32], "rnn": rnn,
                                    "rnn_hidden_size": 16},
                          "learn": {"batch_size": 32, "learning_rate": 0.01, "sequence_length": 4},
                          "collect": {"n_sample": 64}}, seed=0)
    cfg = EasyDict(seed=0, policy=policy.cfg)
    ctx = OnlineRLContext()
    collect = StepCollector(cfg, policy.collect_mode, env)
    estimate, train = gae_estimator(cfg, policy.collect_mode), multistep_trainer(cfg, policy.learn_mode)
    rewards = []
    for _ in range(8):
        collect(ctx)
        traj = ctx.trajectories
        rewards.append(traj.reward.sum().item() / traj.obs.agent_mask.sum().item())
        estimate(ctx)
        assert ctx.train_data.adv.shape[-1] == env.agents
        train(ctx)
    assert rewards[0] < 0.7 and np.mean(rewards[-2:]) > 0.9  # at first 1/3 or 1/2 of the allowed actions are right


def test_simple_spread_returns_bootstrap_where_its_time_limit_cuts_the_episode():
    env_cfg = {"env_id": "mpe/simple_spread_v3", "collector_env_num": 2,
               "env_kwargs": {"N": 3, "max_cycles": 5, "continuous_actions": False}}
    policy = MAPPOPolicy({"model": {"n_agents": 3, "obs_shape": 18, "state_shape": 54, "action_shape": 5,
                                    "hidden_sizes": [16]}, "collect": {"n_sample": 20}}, seed=0)
    cfg = EasyDict(seed=0, policy=policy.cfg)
    ctx = OnlineRLContext()
    with make_env_manager(env_cfg, "collector", seed=0) as env:
        StepCollector(cfg, policy.collect_mode, env)(ctx)
    truncated = ctx.trajectories.truncated.reshape(-1).numpy()
    assert truncated.sum() == 4 and not ctx.trajectories.terminated.any()  # 10 steps of 2 envs: 2 episodes each
    gae_estimator(cfg, policy.collect_mode)(ctx)
    data = ctx.train_data
    # Every agent leaves at the time limit, but was cut short: the last step's return is its reward plus the
    # discounted value of the final observation, never the reward alone (as after a termination).
    assert (data["return"] - data.reward)[truncated].abs().min() > 1e-4


def test_data_parallel_learning_is_refused_in_one_line():
    with pytest.raises(ValueError, match="does not learn data-parallel yet.*run one learner"):
        make().learn_mode.join_data_parallel(object())
