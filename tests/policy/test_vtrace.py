"""V-trace targets: the n-step return on-policy, the clipped importance weights, episode ends, the paper's sum."""
from __future__ import annotations

import math

import pytest
import torch

from conveyor.policy.vtrace import vtrace

GAMMA = 0.9


def unroll(steps=5, envs=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    reward = torch.randn(steps, envs, generator=g)
    value = torch.randn(steps, envs, generator=g)
    bootstrap = torch.randn(envs, generator=g)
    next_value = torch.cat([value[1:], bootstrap[None]])
    return reward, value, bootstrap, next_value


def nstep_returns(reward, bootstrap, discount):
    out = torch.empty_like(reward)
    last = bootstrap
    for t in range(len(reward) - 1, -1, -1):
        last = reward[t] + discount[t] * last
        out[t] = last
    return out


def test_on_policy_with_unit_clips_vs_is_the_nstep_bootstrapped_return():
    reward, value, bootstrap, next_value = unroll()
    logp = torch.randn_like(reward)
    discount = torch.full_like(reward, GAMMA)
    out = vtrace(logp, logp, reward, value, next_value, discount, rho_bar=1.0, c_bar=1.0)
    expected = nstep_returns(reward, bootstrap, discount)
    torch.testing.assert_close(out.vs, expected)
    vs_next = torch.cat([expected[1:], bootstrap[None]])
    torch.testing.assert_close(out.pg_advantage, reward + GAMMA * vs_next - value)
    assert torch.all(out.rho == 1.0)


def test_matches_the_papers_sum_for_off_policy_data():
    reward, value, bootstrap, next_value = unroll(steps=6, envs=4, seed=1)
    behaviour = torch.randn_like(reward)
    target = behaviour + 0.7 * torch.randn_like(reward)
    discount = torch.full_like(reward, GAMMA)
    out = vtrace(behaviour, target, reward, value, next_value, discount, rho_bar=1.2, c_bar=0.9)
    ratio = (target - behaviour).exp()
    rho, c = ratio.clamp(max=1.2), ratio.clamp(max=0.9)
    delta = rho * (reward + GAMMA * next_value - value)
    steps = len(reward)
    for s in range(steps):  # v_s = V(x_s) + sum_t gamma^(t-s) (prod_{i<t} c_i) delta_t  (Espeholt et al., eq. 1)
        total, trace = torch.zeros_like(value[0]), torch.ones_like(value[0])
        for t in range(s, steps):
            total = total + GAMMA ** (t - s) * trace * delta[t]
            trace = trace * c[t]
        torch.testing.assert_close(out.vs[s], value[s] + total)


def test_rho_bar_clips_the_importance_weight_of_the_td_error():
    reward, value, next_value = torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]])
    behaviour, target = torch.tensor([[math.log(0.2)]]), torch.tensor([[math.log(0.8)]])  # ratio 4
    discount = torch.tensor([[GAMMA]])
    td = 1.0 + GAMMA * 2.0 - 0.5
    clipped = vtrace(behaviour, target, reward, value, next_value, discount, rho_bar=1.5, c_bar=1.0)
    assert clipped.rho.item() == pytest.approx(1.5)
    assert clipped.vs.item() == pytest.approx(0.5 + 1.5 * td)
    assert clipped.pg_advantage.item() == pytest.approx(1.5 * td)
    unclipped = vtrace(behaviour, target, reward, value, next_value, discount, rho_bar=None, c_bar=None)
    assert unclipped.vs.item() == pytest.approx(0.5 + 4.0 * td)


def test_c_bar_clips_only_the_trace_not_the_td_error():
    reward, value, bootstrap, next_value = unroll(steps=2, envs=1, seed=2)
    behaviour = torch.log(torch.tensor([[0.25], [0.5]]))
    target = torch.log(torch.tensor([[0.75], [0.5]]))  # ratios 3 and 1
    discount = torch.full_like(reward, GAMMA)
    out = vtrace(behaviour, target, reward, value, next_value, discount, rho_bar=10.0, c_bar=0.5)
    delta = torch.stack([3.0 * (reward[0] + GAMMA * next_value[0] - value[0]),
                         reward[1] + GAMMA * next_value[1] - value[1]])
    torch.testing.assert_close(out.vs[1], value[1] + delta[1])
    torch.testing.assert_close(out.vs[0], value[0] + delta[0] + GAMMA * 0.5 * delta[1])


def test_a_termination_cuts_the_bootstrap():
    reward, value, bootstrap, next_value = unroll(steps=5, envs=1, seed=3)
    logp = torch.zeros_like(reward)
    discount = torch.full_like(reward, GAMMA)
    discount[2] = 0.0  # the episode terminates after step 2; step 3 starts a new one
    next_value[2] = 123.0  # never read across a termination
    out = vtrace(logp, logp, reward, value, next_value, discount)
    torch.testing.assert_close(out.vs, nstep_returns(reward, bootstrap, discount))
    torch.testing.assert_close(out.vs[2], reward[2])
    torch.testing.assert_close(out.pg_advantage[2], reward[2] - value[2])


def test_a_truncation_bootstraps_from_its_own_final_value_and_cuts_the_trace():
    reward, value, bootstrap, next_value = unroll(steps=4, envs=1, seed=4)
    logp = torch.zeros_like(reward)
    discount = torch.full_like(reward, GAMMA)
    done = torch.zeros_like(reward, dtype=torch.bool)
    done[1] = True  # truncated after step 1: the value of its final observation, not of row 2's state
    next_value[1] = torch.tensor([7.0])
    out = vtrace(logp, logp, reward, value, next_value, discount, done)
    torch.testing.assert_close(out.vs[1], reward[1] + GAMMA * 7.0)
    torch.testing.assert_close(out.vs[0], reward[0] + GAMMA * (reward[1] + GAMMA * 7.0))
    torch.testing.assert_close(out.vs[2:], nstep_returns(reward[2:], bootstrap, discount[2:]))
    torch.testing.assert_close(out.pg_advantage[1], reward[1] + GAMMA * 7.0 - value[1])


def test_no_gradient_flows_through_the_targets():
    reward, value, _, next_value = unroll()
    value.requires_grad_(True)
    logp = torch.zeros_like(reward, requires_grad=True)
    out = vtrace(logp.detach(), logp, reward, value, next_value, torch.full_like(reward, GAMMA))
    assert not out.vs.requires_grad and not out.pg_advantage.requires_grad


def test_inputs_of_another_shape_or_a_bad_clip_are_refused():
    reward, value, _, next_value = unroll()
    logp = torch.zeros_like(reward)
    with pytest.raises(ValueError, match="next_value has shape"):
        vtrace(logp, logp, reward, value, next_value[:-1], torch.full_like(reward, GAMMA))
    with pytest.raises(ValueError, match="rho_bar must be > 0"):
        vtrace(logp, logp, reward, value, next_value, torch.full_like(reward, GAMMA), rho_bar=0.0)
