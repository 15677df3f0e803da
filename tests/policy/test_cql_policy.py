"""CQL's conservative penalty against hand-computed values, alone and inside a learn step of each CQL policy."""
from __future__ import annotations

import math

import pytest
import torch
import treetensor.torch as ttorch

from conveyor.policy import CQLPolicy, DiscreteCQLPolicy, continuous_cql_penalty, discrete_cql_penalty
from conveyor.policy.sac import SACModel
from policy_testing import TableQ, transitions


def test_discrete_penalty_is_mean_logsumexp_minus_q_of_the_data_action():
    q_all = torch.tensor([[1.0, 1.0], [0.0, math.log(3.0)]])
    q_data = torch.tensor([1.0, math.log(3.0)])  # actions 0 and 1
    # row 0: log(e + e) - 1 = log 2; row 1: log(1 + 3) - log 3 = log(4/3)
    assert discrete_cql_penalty(q_all, q_data).item() == pytest.approx(0.5 * (math.log(2.0) + math.log(4.0 / 3.0)))


def test_continuous_penalty_importance_weights_each_sample_by_its_proposal_density():
    q_sampled = torch.tensor([[[-math.log(2.0), math.log(2.0)]], [[-math.log(2.0), math.log(2.0)]]])  # [E=2, B=1, M=2]
    log_density = torch.tensor([[0.0, math.log(2.0)]])
    q_data = torch.tensor([[0.0], [1.0]])
    # per critic: log((exp(-log 2 - 0) + exp(log 2 - log 2)) / 2) = log(0.75); summed over critics minus Q(data)
    expected = (math.log(0.75) - 0.0) + (math.log(0.75) - 1.0)
    assert continuous_cql_penalty(q_sampled, log_density, q_data).item() == pytest.approx(expected)


def test_discrete_cql_adds_alpha_times_the_penalty_to_dqns_td_loss():
    table = [[1.0, 1.0], [0.0, math.log(3.0)], [0.0, 0.0]]
    policy = DiscreteCQLPolicy({"discount_factor": 0.9, "learn": {"loss": "mse", "cql_alpha": 2.0}},
                               model=TableQ(table), seed=0)
    batch = transitions(obs=[0, 1], action=[0, 1], reward=[1.0, math.log(3.0)], next_obs=[2, 2],
                        terminated=[True, True], truncated=[False, False])
    out = policy.learn_mode.forward(batch)
    assert out["losses/td"] == pytest.approx(0.0, abs=1e-6)  # Q(s, a) equals the reward already
    assert out["losses/cql"] == pytest.approx(2.0 * 0.5 * (math.log(2.0) + math.log(4.0 / 3.0)), rel=1e-6)
    # The penalty's gradient lowers the action the data did not take and raises the one it did (state 0 is
    # tied, so there the softmax's half is below the data action's one).
    new = policy.model.table.detach()
    assert new[0, 1] < 1.0 < new[0, 0] and new[1, 0] < 0.0 and new[1, 1] > math.log(3.0)


class _ConstantQ(torch.nn.Module):
    """Critics whose Q(s, a) = w_i * a[0]: the penalty is then computable by hand for any sampled actions."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([[1.0], [2.0]]))

    def forward(self, obs, action):
        return self.w * action[:, 0]  # [E, B]


def test_continuous_cql_penalty_in_a_learn_step_uses_all_three_proposals_at_s():
    from conveyor.policy import TanhGaussianActor
    policy = CQLPolicy({"model": {"obs_shape": 1, "action_shape": 1, "hidden_sizes": [4]},
                        "learn": {"cql_alpha": 0.5, "cql_n_actions": 4}},
                       model=SACModel(TanhGaussianActor(1, 1, hidden_sizes=[4]), _ConstantQ()), seed=0)
    batch = ttorch.Tensor({"obs": torch.zeros(3, 1), "next_obs": torch.ones(3, 1),
                           "action": torch.tensor([[0.5], [-0.5], [0.0]]), "reward": torch.zeros(3),
                           "terminated": torch.ones(3, dtype=torch.bool),
                           "truncated": torch.zeros(3, dtype=torch.bool)})
    # Recompute the penalty from the same draws: the learner's generator, as the step will use it.
    generator = torch.Generator().set_state(policy._learn_generator.get_state())
    policy.actor.sample(batch.next_obs, generator=generator)  # the SAC critic target draws first
    uniform = torch.rand((12, 1), generator=generator) * 2 - 1
    a_pi, logp_pi = policy.actor.sample(torch.zeros(12, 1), generator=generator)
    a_next, logp_next = policy.actor.sample(torch.ones(12, 1), generator=generator)
    total = 0.0
    for w, critic_data in ((1.0, torch.tensor([0.5, -0.5, 0.0])), (2.0, 2 * torch.tensor([0.5, -0.5, 0.0]))):
        for b in range(3):
            rows = slice(4 * b, 4 * b + 4)
            terms = torch.cat([w * uniform[rows, 0] + math.log(2.0), w * a_pi[rows, 0] - logp_pi[rows],
                               w * a_next[rows, 0] - logp_next[rows]])
            total += (torch.logsumexp(terms, 0) - math.log(12) - critic_data[b]).item() / 3
    out = policy.learn_mode.forward(batch)
    assert out["losses/cql"] == pytest.approx(0.5 * total, rel=1e-5)


@pytest.mark.parametrize("warmup, same", [(2, True), (0, False)])
def test_during_the_bc_warmup_the_actor_clones_the_data_and_reads_no_q(warmup, same):
    batch = ttorch.Tensor({"obs": torch.randn(8, 3, generator=torch.Generator().manual_seed(1)),
                           "next_obs": torch.zeros(8, 3), "action": torch.full((8, 1), 0.5),
                           "reward": torch.zeros(8), "terminated": torch.zeros(8, dtype=torch.bool),
                           "truncated": torch.zeros(8, dtype=torch.bool)})

    def actor_after_a_step(critic_scale):
        torch.manual_seed(0)  # the same initial networks
        policy = CQLPolicy({"model": {"obs_shape": 3, "action_shape": 1, "hidden_sizes": [8]},
                            "learn": {"bc_warmup_steps": warmup}}, seed=0)
        with torch.no_grad():
            for p in policy.critic.parameters():
                p.mul_(critic_scale)  # another Q: the actor's step must not see it while it clones
        policy.learn_mode.forward(batch)
        return [p.detach().clone() for p in policy.actor.parameters()]

    a, b = actor_after_a_step(1.0), actor_after_a_step(3.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) == same


def test_the_bc_warmup_raises_the_data_actions_likelihood():
    from conveyor.policy.continuous import tanh_gaussian_log_prob
    obs = torch.randn(16, 3, generator=torch.Generator().manual_seed(2))
    batch = ttorch.Tensor({"obs": obs, "next_obs": obs, "action": torch.full((16, 1), 0.7), "reward": torch.zeros(16),
                           "terminated": torch.zeros(16, dtype=torch.bool),
                           "truncated": torch.zeros(16, dtype=torch.bool)})
    policy = CQLPolicy({"model": {"obs_shape": 3, "action_shape": 1, "hidden_sizes": [16]},
                        "learn": {"bc_warmup_steps": 50, "actor_learning_rate": 1e-2}}, seed=0)

    def likelihood():
        with torch.no_grad():
            return tanh_gaussian_log_prob(*policy.actor(obs), batch.action).mean().item()

    before = likelihood()
    for _ in range(50):
        policy.learn_mode.forward(batch)
    assert likelihood() > before + 1.0
