"""TD3Policy through its public API: target policy smoothing, delayed actor and target updates, clipped double
Q targets, exploration, checkpoints; the pendulum/td3 entry in one process and async, and a run that learns."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from torch import nn

from conveyor import task
from conveyor.engine import FINISH_EVENT
from conveyor.policy import TD3Policy
from conveyor.zoo import load_entry
from policy_testing import through_bytes
from tests.zoo.test_sac_entries import tiny

GAMMA = 0.9
entry = load_entry("pendulum/td3")


def small_cfg(action_dim: int = 2, **learn) -> dict:
    return {"discount_factor": GAMMA, "model": {"obs_shape": 3, "action_shape": action_dim, "hidden_sizes": [32, 32],
                                                "action_low": -2.0, "action_high": 2.0}, "learn": learn}


def random_batch(seed: int, n: int = 32, action_dim: int = 2) -> ttorch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return ttorch.Tensor({
        "obs": torch.randn(n, 3, generator=g), "next_obs": torch.randn(n, 3, generator=g),
        "action": 4 * torch.rand(n, action_dim, generator=g) - 2, "reward": torch.randn(n, generator=g),
        "terminated": torch.rand(n, generator=g) < 0.2, "truncated": torch.zeros(n, dtype=torch.bool)})


def params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def set_target_actor_output(policy: TD3Policy, bias: float) -> None:
    """The target actor acts ``tanh(bias)`` whatever the observation."""
    with torch.no_grad():
        policy.target_actor.head.weight.zero_()
        policy.target_actor.head.bias.fill_(bias)


# --- target policy smoothing -----------------------------------------------------------------------
def test_target_smoothing_noise_is_clipped_to_noise_clip():
    policy = TD3Policy(small_cfg(target_noise=10.0, noise_clip=0.3), seed=0)
    set_target_actor_output(policy, 0.0)
    action = policy.target_action(torch.randn(2000, 3))
    assert action.abs().max().item() == pytest.approx(0.3)
    assert (action.abs() == 0.3).float().mean() > 0.9  # std 10 clipped to 0.3: nearly every draw hits the clip
    assert action.std() > 0  # noise is there


def test_smoothed_target_action_stays_within_the_action_bounds():
    policy = TD3Policy(small_cfg(target_noise=0.5, noise_clip=0.5), seed=0)
    set_target_actor_output(policy, 5.0)  # tanh(5) ~ 0.9999: most noise would push past 1
    action = policy.target_action(torch.randn(2000, 3))
    assert action.max().item() == 1.0 and action.min().item() >= 0.4999
    set_target_actor_output(policy, -5.0)
    assert policy.target_action(torch.randn(2000, 3)).min().item() == -1.0


def test_without_target_noise_the_target_action_is_the_target_actors():
    policy = TD3Policy(small_cfg(target_noise=0.0), seed=0)
    obs = torch.randn(16, 3)
    torch.testing.assert_close(policy.target_action(obs), policy.target_actor(obs))


# --- learning ---------------------------------------------------------------------------------------
def test_actor_and_targets_update_every_policy_delay_steps_critics_every_step():
    policy = TD3Policy(small_cfg(policy_delay=3), seed=0)
    nets = {"actor": policy.actor, "critic": policy.critic, "target_actor": policy.target_actor,
            "target_critic": policy.target_critic}
    changed = {name: [] for name in nets}
    reported = []
    for step in range(7):
        before = {name: params(net) for name, net in nets.items()}
        out = policy.learn_mode.forward(random_batch(step))
        reported.append("losses/actor" in out)
        for name, net in nets.items():
            changed[name].append(not same(before[name], params(net)))
    delayed = [step % 3 == 0 for step in range(7)]  # the first step, then every third
    assert changed["critic"] == [True] * 7
    assert changed["actor"] == changed["target_actor"] == changed["target_critic"] == reported == delayed
    assert policy.learn_mode.train_iter == 7


def test_target_q_is_the_minimum_of_the_two_target_critics():
    policy = TD3Policy(small_cfg(target_noise=0.0), seed=0)
    batch = random_batch(1, n=64)
    with torch.no_grad():
        next_q = policy.target_critic(batch.next_obs, policy.target_actor(batch.next_obs))  # [2, B]
    not_done = 1.0 - batch.terminated.float()
    expected = batch.reward + GAMMA * not_done * next_q.min(0).values
    assert not torch.equal(next_q[0], next_q[1]) and (next_q[0] < next_q[1]).any() and (next_q[0] > next_q[1]).any()
    out = policy.learn_mode.forward(batch)
    assert out["charts/target_q_mean"] == pytest.approx(expected.mean().item(), abs=1e-5)
    for member in range(2):  # neither critic alone gives that target
        alone = batch.reward + GAMMA * not_done * next_q[member]
        assert out["charts/target_q_mean"] != pytest.approx(alone.mean().item(), abs=1e-5)


def test_checkpoint_round_trip_gives_the_identical_next_learn_steps():
    policy = TD3Policy(small_cfg(), seed=0)
    for step in range(3):
        policy.learn_mode.forward(random_batch(step))
    restored = TD3Policy(small_cfg(), seed=99)
    restored.load_state_dict(through_bytes(policy.state_dict()))
    assert set(policy.state_dict()) >= {"target_actor", "target_critic", "actor_optimizer", "critic_optimizer",
                                        "learn_rng"}
    for step in range(3, 5):  # an actor step (train_iter 3 -> no; 4 -> yes) either way: both must agree
        a, b = policy.learn_mode.forward(random_batch(step)), restored.learn_mode.forward(random_batch(step))
        assert a == b
    for mine, theirs in ((policy.model, restored.model), (policy.target_actor, restored.target_actor),
                         (policy.target_critic, restored.target_critic)):
        assert same(params(mine), params(theirs))


def test_prioritized_batches_get_priorities():
    batch = random_batch(0)
    batch.weight = torch.ones(32)
    out = TD3Policy(small_cfg(), seed=0).learn_mode.forward(batch)
    assert out.priorities.shape == (32,) and (out.priorities >= 0).all()


# --- acting -----------------------------------------------------------------------------------------
def test_collect_adds_clipped_exploration_noise_and_eval_acts_deterministically_without_an_optimizer():
    policy = TD3Policy(small_cfg(), seed=0)
    obs = np.random.default_rng(0).standard_normal((500, 3)).astype(np.float32)
    evaluated = policy.eval_mode.forward(obs)["action"]
    collected = policy.collect_mode.forward(obs)["action"]
    assert np.array_equal(evaluated, policy.eval_mode.forward(obs)["action"])
    assert not np.allclose(evaluated, collected) and np.abs(collected).max() <= 2.0
    spread = (collected - evaluated)[np.abs(evaluated).max(-1) < 1.0]  # away from the bounds: noise std 0.1 * 2
    assert 0.15 < spread.std() < 0.25
    assert not policy.actor_optimizer.made and not policy.critic_optimizer.made
    quiet = TD3Policy({**small_cfg(), "collect": {"exploration_noise": 0.0}}, seed=0)
    assert np.array_equal(quiet.collect_mode.forward(obs)["action"], quiet.eval_mode.forward(obs)["action"])


# --- the pendulum/td3 entry ---------------------------------------------------------------------------
@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_entry_trains_in_one_process(in_tmp):
    ctx = entry.main(tiny(entry), exp_name="smoke", max_env_step=300, progress=False)
    assert ctx.env_step >= 300 and ctx.train_iter > 0 and ctx.last_eval_value is not None
    assert (in_tmp / "runs" / "smoke" / "ckpt" / "final.pth.tar").is_file()


def test_entry_trains_in_async_mode_with_a_td3_collector_process(in_tmp):
    middleware = []
    task.on(FINISH_EVENT, lambda error: middleware.extend(task.stats()))
    ctx = entry.main(tiny(entry), exp_name="smoke_async", max_env_step=300, async_mode=True, progress=False)
    assert ctx.env_step >= 300 and ctx.train_iter > 0
    assert "ProcessCollector" in middleware and "StepCollector" not in middleware


@pytest.mark.slow
def test_td3_learns_pendulum(in_tmp):
    """The entry's settings on 64x64 networks and batch 128, evaluated every 500 gradient steps (about 37 s)."""
    cfg = copy.deepcopy(entry.main_config)
    cfg.policy.model.hidden_sizes = [64, 64]
    cfg.policy.learn.batch_size = 128
    cfg.policy.eval.evaluator.eval_freq = 500
    ctx = entry.main(cfg, exp_name="learns", seed=0, max_env_step=10000, progress=False)
    assert ctx.last_eval_value is not None and ctx.last_eval_value >= -250, ctx.last_eval_value
