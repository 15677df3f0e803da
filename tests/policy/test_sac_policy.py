"""SACPolicy and its continuous-action pieces through their public API: squashed Gaussian densities,
action bounds, bootstrap targets, temperature and target updates, prioritized replay, checkpoints."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict
from torch import nn

from conveyor.config import compile_config
from conveyor.policy.continuous import ActionScaler, EnsembleQ, TanhGaussianActor, tanh_gaussian_log_prob
from conveyor.policy.sac import SACModel, SACPolicy
from conveyor.schema import ConfigError
from policy_testing import through_bytes

GAMMA = 0.9


def small_cfg(obs_dim: int = 3, action_dim: int = 2, **learn) -> dict:
    return {"discount_factor": GAMMA, "model": {"obs_shape": obs_dim, "action_shape": action_dim,
                                                "hidden_sizes": [32, 32]}, "learn": learn}


def random_batch(seed: int, n: int = 32, obs_dim: int = 3, action_dim: int = 2, low: float = -1.0,
                 high: float = 1.0) -> ttorch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return ttorch.Tensor({
        "obs": torch.randn(n, obs_dim, generator=g), "next_obs": torch.randn(n, obs_dim, generator=g),
        "action": low + (high - low) * torch.rand(n, action_dim, generator=g),
        "reward": torch.randn(n, generator=g), "terminated": torch.rand(n, generator=g) < 0.2,
        "truncated": torch.zeros(n, dtype=torch.bool)})


# --- the tanh-squashed Gaussian ------------------------------------------------------------------
def test_tanh_gaussian_log_prob_matches_torch_transformed_distribution():
    g = torch.Generator().manual_seed(0)
    mean, log_std = torch.randn(64, 3, generator=g), 0.5 * torch.randn(64, 3, generator=g)
    action = torch.rand(64, 3, generator=g) * 1.8 - 0.9
    reference = torch.distributions.TransformedDistribution(
        torch.distributions.Normal(mean, log_std.exp()), [torch.distributions.TanhTransform()])
    torch.testing.assert_close(tanh_gaussian_log_prob(mean, log_std, action), reference.log_prob(action).sum(-1),
                               rtol=1e-4, atol=1e-4)


def test_tanh_gaussian_density_integrates_to_one_over_the_squashed_range():
    mean, log_std = torch.tensor([[0.7]], dtype=torch.float64), torch.tensor([[-0.3]], dtype=torch.float64)
    grid = torch.linspace(-1 + 1e-9, 1 - 1e-9, 400_001, dtype=torch.float64)
    density = tanh_gaussian_log_prob(mean, log_std, grid.reshape(-1, 1), eps=1e-12).exp()
    assert torch.trapezoid(density, grid).item() == pytest.approx(1.0, abs=1e-4)


def test_sampled_log_prob_is_the_density_of_the_sampled_action():
    torch.manual_seed(0)
    actor = TanhGaussianActor(4, 2, hidden_sizes=[16])
    obs = torch.randn(256, 4)
    action, log_prob = actor.sample(obs, generator=torch.Generator().manual_seed(1))
    mean, log_std = actor(obs)
    torch.testing.assert_close(log_prob, tanh_gaussian_log_prob(mean, log_std, action), rtol=1e-3, atol=1e-3)


def test_log_prob_stays_finite_for_saturated_actions():
    torch.manual_seed(0)
    actor = TanhGaussianActor(2, 1, hidden_sizes=[8])
    with torch.no_grad():
        actor.head.bias.fill_(30.0)  # mean 30, tanh(u) == 1.0 in float32
    action, log_prob = actor.sample(torch.zeros(16, 2))
    assert bool(torch.isfinite(log_prob).all()) and bool((action <= 1.0).all())


def test_log_std_stays_inside_its_bounds():
    actor = TanhGaussianActor(2, 3, hidden_sizes=[8], log_std_bounds=(-4.0, 1.0))
    with torch.no_grad():
        actor.head.bias.copy_(torch.tensor([0.0] * 3 + [-100.0, 0.0, 100.0]))
    _, log_std = actor(torch.zeros(1, 2))
    assert -4.0 <= log_std.min().item() and log_std.max().item() <= 1.0


def test_state_independent_std_is_one_parameter_per_action_dim():
    actor = TanhGaussianActor(5, 3, hidden_sizes=[8], state_dependent_std=False)
    _, log_std = actor(torch.randn(7, 5))
    assert log_std.shape == (7, 3) and torch.equal(log_std[0], log_std[6])
    assert actor.log_std_param.shape == (3,)


# --- critics -------------------------------------------------------------------------------------
def test_ensemble_critics_are_independent_networks_evaluated_at_once():
    torch.manual_seed(0)
    critic = EnsembleQ(3, 2, hidden_sizes=[16, 16], ensemble_size=2)
    q = critic(torch.randn(10, 3), torch.randn(10, 2))
    assert q.shape == (2, 10) and not torch.allclose(q[0], q[1])


def test_ensemble_critic_takes_dict_observations():
    critic = EnsembleQ({"pos": 3, "goal": 2}, 1, hidden_sizes=[16, 16])
    obs = ttorch.Tensor({"pos": torch.randn(4, 3), "goal": torch.randn(4, 2)})
    assert critic(obs, torch.randn(4, 1)).shape == (2, 4)


# --- action bounds -------------------------------------------------------------------------------
def bounded_policy(low, high, seed: int = 0) -> SACPolicy:
    cfg = small_cfg(obs_dim=3, action_dim=2)
    cfg["model"].update(action_low=low, action_high=high)
    return SACPolicy(cfg, seed=seed)


@pytest.mark.parametrize("bias", [-50.0, 0.0, 50.0])
def test_collected_and_eval_actions_respect_the_env_bounds(bias):
    policy = bounded_policy([-2.0, 0.0], [2.0, 5.0])
    with torch.no_grad():
        policy.actor.head.bias[:2].fill_(bias)  # push the mean to a bound (or keep it central)
        policy.actor.head.bias[2:].fill_(5.0)  # and the std wide
    obs = np.random.default_rng(0).normal(size=(512, 3)).astype(np.float32)
    for action in (policy.collect_mode.forward(obs)["action"], policy.eval_mode.forward(obs)["action"]):
        assert action.shape == (512, 2) and action.dtype == np.float32
        assert (action[:, 0] >= -2.0).all() and (action[:, 0] <= 2.0).all()
        assert (action[:, 1] >= 0.0).all() and (action[:, 1] <= 5.0).all()


def test_collected_actions_spread_over_the_whole_range():
    policy = bounded_policy(-2.0, 2.0)
    with torch.no_grad():
        policy.actor.head.bias[2:].fill_(10.0)  # widest std
    action = policy.collect_mode.forward(np.zeros((2000, 3), np.float32))["action"]
    assert action.min() < -1.9 and action.max() > 1.9


def test_eval_mode_is_deterministic_and_collect_mode_samples():
    policy = bounded_policy(-1.0, 1.0)
    obs = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    np.testing.assert_array_equal(policy.eval_mode.forward(obs)["action"], policy.eval_mode.forward(obs)["action"])
    assert not np.array_equal(policy.collect_mode.forward(obs)["action"], policy.collect_mode.forward(obs)["action"])


def test_collected_actions_are_reproducible_from_the_seed():
    obs = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)  # the same weights; the exploration noise comes from seed=
        twin = bounded_policy(-1.0, 1.0, seed=7)
        runs.append(np.stack([twin.collect_mode.forward(obs)["action"] for _ in range(3)]))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_action_scaler_maps_bounds_both_ways():
    scaler = ActionScaler(2, [-2.0, 0.0], [2.0, 5.0])
    squashed = torch.tensor([[-1.0, -1.0], [0.0, 0.0], [1.0, 1.0]])
    env = scaler.to_env(squashed)
    torch.testing.assert_close(env, torch.tensor([[-2.0, 0.0], [0.0, 2.5], [2.0, 5.0]]))
    torch.testing.assert_close(scaler.from_env(env), squashed)


def test_compile_config_fills_action_bounds_from_the_env():
    cfg = compile_config(EasyDict(env={"env_id": "Pendulum-v1"}, policy={}), policy=SACPolicy)
    assert (cfg.policy.model.obs_shape, cfg.policy.model.action_shape) == (3, 1)
    assert (cfg.policy.model.action_low, cfg.policy.model.action_high) == (-2.0, 2.0)


def test_infinite_action_bounds_are_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match=r"action_low.*RescaleAction"):
        bounded_policy(-math.inf, 1.0)


def test_bounds_of_the_wrong_length_are_a_config_error():
    with pytest.raises(ConfigError, match="one value per dim"):
        bounded_policy([-1.0, -1.0, -1.0], 1.0)


# --- bootstrap targets ---------------------------------------------------------------------------
class TableCritics(nn.Module):
    """Two critics read from a table by integer state: Q_1 = table[s], Q_2 = table[s] + 1 (min is Q_1)."""

    def __init__(self, table: list[float]) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.tensor(table))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        q = self.table[obs.long().reshape(-1)]
        return torch.stack([q, q + 1.0])


def table_policy(**learn) -> SACPolicy:
    """Critics valued 0 at state 0 and 3 at state 1; a negligible fixed temperature, so targets are plain TD."""
    cfg = {"discount_factor": GAMMA, "model": {"obs_shape": 1, "action_shape": 1},
           "learn": {"auto_alpha": False, "alpha": 1e-9, **learn}}
    model = SACModel(TanhGaussianActor(1, 1, hidden_sizes=[8]), TableCritics([0.0, 3.0]))
    return SACPolicy(cfg, model=model, seed=0)


def target_of(policy: SACPolicy, **fields) -> float:
    batch = {"obs": torch.tensor([0]), "next_obs": torch.tensor([1]), "action": torch.tensor([[0.0]]),
             "reward": torch.tensor([1.0]), "terminated": torch.tensor([False]), "truncated": torch.tensor([False])}
    batch.update({k: torch.tensor(v) for k, v in fields.items()})
    return policy.learn_mode.forward(ttorch.Tensor(batch))["charts/target_q_mean"]


def test_truncated_transition_bootstraps_from_the_smaller_target_critic():
    assert target_of(table_policy(), truncated=[True]) == pytest.approx(1.0 + GAMMA * 3.0, abs=1e-5)


def test_terminated_transition_does_not_bootstrap():
    assert target_of(table_policy(), terminated=[True]) == pytest.approx(1.0, abs=1e-6)


def test_batch_discount_from_nstep_replaces_discount_factor():
    assert target_of(table_policy(), discount=[0.5]) == pytest.approx(1.0 + 0.5 * 3.0, abs=1e-5)


def test_entropy_bonus_enters_the_target():
    policy = table_policy(alpha=0.5)
    batch = {"obs": torch.tensor([0]), "next_obs": torch.tensor([1]), "action": torch.tensor([[0.0]]),
             "reward": torch.tensor([1.0]), "terminated": torch.tensor([False]), "truncated": torch.tensor([False])}
    target = policy.learn_mode.forward(ttorch.Tensor(batch))["charts/target_q_mean"]
    assert target != pytest.approx(1.0 + GAMMA * 3.0, abs=1e-3)  # shifted by -gamma * alpha * log pi(a'|s')


def test_nstep_config_without_batch_discount_is_an_error():
    policy = SACPolicy({**small_cfg(), "nstep": 3}, seed=0)
    with pytest.raises(ValueError, match="n-step enhancer"):
        policy.learn_mode.forward(random_batch(0))


# --- temperature -----------------------------------------------------------------------------------
def test_alpha_rises_while_entropy_is_below_target():
    policy = SACPolicy(small_cfg(target_entropy=5.0), seed=0)  # above any squashed policy's entropy
    before = policy.alpha
    out = policy.learn_mode.forward(random_batch(0))
    assert out["charts/entropy"] < 5.0 and policy.alpha > before


def test_alpha_falls_while_entropy_is_above_target():
    policy = SACPolicy(small_cfg(target_entropy=-20.0), seed=0)
    before = policy.alpha
    out = policy.learn_mode.forward(random_batch(0))
    assert out["charts/entropy"] > -20.0 and policy.alpha < before


def test_default_target_entropy_is_minus_action_dim():
    assert SACPolicy(small_cfg(action_dim=3), seed=0).target_entropy == -3.0


def test_fixed_alpha_does_not_move():
    policy = SACPolicy(small_cfg(auto_alpha=False, alpha=0.3), seed=0)
    for i in range(3):
        out = policy.learn_mode.forward(random_batch(i))
    assert policy.alpha == pytest.approx(0.3) and out["charts/alpha"] == pytest.approx(0.3)


# --- updates ---------------------------------------------------------------------------------------
def test_soft_target_update_moves_target_critics_by_theta_each_step():
    policy = SACPolicy(small_cfg(target_theta=0.25), seed=0)
    before = [p.detach().clone() for p in policy.target_critic.parameters()]
    policy.learn_mode.forward(random_batch(0))
    for old, target, online in zip(before, policy.target_critic.parameters(), policy.critic.parameters()):
        torch.testing.assert_close(target, 0.75 * old + 0.25 * online.detach())
        assert not torch.equal(target, online)


def test_target_critics_get_no_gradients():
    policy = SACPolicy(small_cfg(), seed=0)
    policy.learn_mode.forward(random_batch(0))
    assert all(p.grad is None and not p.requires_grad for p in policy.target_critic.parameters())


def test_actor_loss_puts_no_gradient_into_the_critics():
    policy = SACPolicy(small_cfg(), seed=0)
    at_critic_step = []
    step = policy.critic_optimizer.step

    def recording_step(*args, **kwargs):
        at_critic_step.extend(p.grad.clone() for p in policy.critic.parameters())
        return step(*args, **kwargs)

    policy.critic_optimizer.step = recording_step
    policy.learn_mode.forward(random_batch(0))
    for recorded, param in zip(at_critic_step, policy.critic.parameters()):
        assert torch.equal(param.grad, recorded)  # the actor's backward pass left them as the critic loss made them
    assert all(p.requires_grad for p in policy.critic.parameters())


def test_metrics_are_namespaced_floats():
    out = SACPolicy(small_cfg(), seed=0).learn_mode.forward(random_batch(0)).metrics
    assert set(out) == {"losses/q", "losses/actor", "losses/alpha", "charts/alpha", "charts/entropy",
                        "charts/q_mean", "charts/target_q_mean"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.values())


def test_gradient_norms_are_reported_when_clipping():
    out = SACPolicy(small_cfg(grad_clip=1.0), seed=0).learn_mode.forward(random_batch(0))
    assert out["charts/critic_grad_norm"] > 0.0 and out["charts/actor_grad_norm"] > 0.0


def test_learning_rates_can_be_set_apiece():
    policy = SACPolicy(small_cfg(learning_rate=1e-3, actor_learning_rate=1e-4), seed=0)
    assert policy.actor_optimizer.param_groups[0]["lr"] == 1e-4
    assert policy.critic_optimizer.param_groups[0]["lr"] == 1e-3
    assert policy.alpha_optimizer.param_groups[0]["lr"] == 1e-3


# --- prioritized replay ----------------------------------------------------------------------------
def test_priority_is_mean_absolute_td_error_of_the_critics():
    policy = table_policy()
    batch = {"obs": torch.tensor([0, 0]), "next_obs": torch.tensor([1, 1]), "action": torch.zeros(2, 1),
             "reward": torch.tensor([1.0, 2.0]), "terminated": torch.tensor([True, True]),
             "truncated": torch.tensor([False, False]), "weight": torch.ones(2)}
    out = policy.learn_mode.forward(ttorch.Tensor(batch))
    # Q_1 = 0, Q_2 = 1 at state 0; targets are the rewards.
    np.testing.assert_allclose(out.priorities, [(1.0 + 0.0) / 2, (2.0 + 1.0) / 2], rtol=1e-6)


def test_importance_weights_scale_the_critic_loss():
    losses = []
    for w in (1.0, 2.0):
        batch = random_batch(0)
        batch.weight = torch.full((32,), w)
        torch.manual_seed(0)
        losses.append(SACPolicy(small_cfg(), seed=0).learn_mode.forward(batch)["losses/q"])
    assert losses[1] == pytest.approx(2.0 * losses[0], rel=1e-5)


def test_no_priority_without_importance_weights():
    assert SACPolicy(small_cfg(), seed=0).learn_mode.forward(random_batch(0)).priorities is None


# --- observations and models ----------------------------------------------------------------------
def test_dict_observations_flow_through_collect_eval_and_learn():
    policy = SACPolicy({"model": {"obs_shape": {"pos": 3, "goal": 2}, "action_shape": 2, "hidden_sizes": [16, 16]},
                        "learn": {"batch_size": 8}}, seed=0)
    rng = np.random.default_rng(0)

    def obs(n):
        return {"pos": rng.normal(size=(n, 3)).astype(np.float32), "goal": rng.normal(size=(n, 2)).astype(np.float32)}

    assert policy.collect_mode.forward(obs(5))["action"].shape == (5, 2)
    assert policy.eval_mode.forward(obs(5))["action"].shape == (5, 2)
    out = policy.learn_mode.forward({"obs": obs(8), "next_obs": obs(8), "action": rng.uniform(-1, 1, (8, 2)),
                                     "reward": np.ones(8, np.float32), "terminated": np.zeros(8, bool),
                                     "truncated": np.zeros(8, bool)})
    assert np.isfinite(out["losses/q"])


def test_a_model_without_actor_and_critic_is_an_error():
    with pytest.raises(TypeError, match="'actor'.*'critic'"):
        SACPolicy(small_cfg(), model=nn.Linear(3, 2))


# --- checkpoints -----------------------------------------------------------------------------------
def test_state_dict_covers_actor_critics_targets_optimizers_alpha_and_counters():
    state = SACPolicy(small_cfg(), seed=0).state_dict()
    assert set(state) == {"model", "target_critic", "actor_optimizer", "critic_optimizer", "temperature",
                          "alpha_optimizer", "rng", "learn_rng", "counters"}
    assert any(k.startswith("actor.") for k in state["model"]) and any(k.startswith("critic.") for k in state["model"])


def test_state_dict_round_trip_restores_everything():
    cfg = small_cfg(target_theta=0.1)
    trained = SACPolicy(cfg, seed=1)
    for i in range(5):
        trained.learn_mode.forward(random_batch(i))
    trained.learn_mode.publish()  # as a learner does after its steps
    obs = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    trained.collect_mode.forward(obs)
    resumed = SACPolicy(cfg, seed=2)
    resumed.load_state_dict(through_bytes(trained.state_dict()))

    assert resumed.learn_mode.train_iter == 5
    assert resumed.alpha == trained.alpha and trained.alpha != pytest.approx(0.2)
    for a, b in [(trained.model, resumed.model), (trained.target_critic, resumed.target_critic)]:
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), name
    # The same next step: optimizer moments, temperature and both noise generators came back too.
    out_a, out_b = (p.learn_mode.forward(random_batch(99)) for p in (trained, resumed))
    assert out_a == out_b
    for x, y in zip(trained.model.parameters(), resumed.model.parameters()):
        assert torch.equal(x, y)
    assert trained.alpha == resumed.alpha
    np.testing.assert_array_equal(trained.collect_mode.forward(obs)["action"],
                                  resumed.collect_mode.forward(obs)["action"])


# --- learning --------------------------------------------------------------------------------------
def test_sac_learns_a_one_step_continuous_bandit():
    """Reward -(a - target(s))^2 with target(s) = 0.5 * s; episodes end at once."""
    torch.manual_seed(0)
    policy = SACPolicy({"model": {"obs_shape": 1, "action_shape": 1, "hidden_sizes": [32, 32]},
                        "learn": {"learning_rate": 3e-3, "alpha": 0.01}}, seed=0)
    rng = np.random.default_rng(0)
    for _ in range(300):
        s = rng.uniform(-1, 1, size=(64, 1)).astype(np.float32)
        a = rng.uniform(-1, 1, size=(64, 1)).astype(np.float32)
        policy.learn_mode.forward({"obs": s, "next_obs": s, "action": a,
                                   "reward": -((a - 0.5 * s) ** 2).sum(-1).astype(np.float32),
                                   "terminated": np.ones(64, bool), "truncated": np.zeros(64, bool)})
    policy.learn_mode.publish()
    s = np.array([[-1.0], [0.0], [1.0]], np.float32)
    np.testing.assert_allclose(policy.eval_mode.forward(s)["action"][:, 0], [-0.5, 0.0, 0.5], atol=0.15)


# --- config ----------------------------------------------------------------------------------------
def test_default_config_is_the_schema_defaults():
    cfg = SACPolicy.default_config()
    assert cfg.learn.auto_alpha is True and cfg.learn.target_theta == 0.005 and cfg.model.critic_num == 2
    assert cfg.model.hidden_sizes == [256, 256] and cfg.learn.batch_size == 256
    assert cfg.collect.random_collect_size >= 0 and cfg.other.replay_buffer.size > 0


def test_misspelt_config_key_is_an_error_naming_the_closest_key():
    with pytest.raises(ConfigError, match=r"policy\.learn\.target_theta"):
        SACPolicy({**small_cfg(), "learn": {"target_tehta": 0.01}})


def test_bad_config_values_are_errors():
    with pytest.raises(ConfigError, match=r"policy\.learn\.target_theta"):
        SACPolicy(small_cfg(target_theta=0.0))
    with pytest.raises(ConfigError, match=r"policy\.learn\.alpha"):
        SACPolicy(small_cfg(alpha=-1.0))
    with pytest.raises(ConfigError, match=r"policy\.model\.log_std_bounds"):
        SACPolicy({"model": {"obs_shape": 3, "action_shape": 1, "log_std_bounds": [2.0, -5.0]}})


def test_discrete_action_shape_is_an_error():
    with pytest.raises(ConfigError, match=r"policy\.model\.action_shape"):
        SACPolicy({"model": {"obs_shape": 3, "action_shape": [2, 2]}})
