"""n-step returns against hand-computed cases."""
import pytest
import torch
import treetensor.torch as ttorch

from conveyor.middleware import nstep_returns


def chunk(T, N, terminated=(), truncated=()):
    term = torch.zeros(T, N, dtype=torch.bool)
    trunc = torch.zeros(T, N, dtype=torch.bool)
    for t, i in terminated:
        term[t, i] = True
    for t, i in truncated:
        trunc[t, i] = True
    return ttorch.Tensor({"obs": torch.zeros(T, N, 1), "reward": torch.arange(1.0, T * N + 1).reshape(T, N),
                          "next_obs": torch.arange(float(T * N)).reshape(T, N, 1), "terminated": term,
                          "truncated": trunc})


def test_full_window_sums_discounted_rewards_and_bootstraps_n_steps_ahead():
    b = nstep_returns(chunk(4, 1), gamma=0.5, nstep=3)
    assert b.reward[0, 0].item() == pytest.approx(1 + 0.5 * 2 + 0.25 * 3)
    assert b.discount[0, 0].item() == pytest.approx(0.125)
    assert b.next_obs[0, 0, 0].item() == 2.0  # next_obs of step 2
    assert not b.terminated[0, 0]


def test_window_stops_at_termination_and_does_not_bootstrap():
    b = nstep_returns(chunk(4, 1, terminated=[(1, 0)]), gamma=0.5, nstep=3)
    assert b.reward[0, 0].item() == pytest.approx(1 + 0.5 * 2)
    assert b.terminated[0, 0] and not b.truncated[0, 0]
    assert b.discount[0, 0].item() == pytest.approx(0.25)


def test_window_stops_at_truncation_and_bootstraps_from_the_final_observation():
    b = nstep_returns(chunk(4, 1, truncated=[(1, 0)]), gamma=0.5, nstep=3)
    assert b.reward[0, 0].item() == pytest.approx(1 + 0.5 * 2)
    assert b.truncated[0, 0] and not b.terminated[0, 0]
    assert b.next_obs[0, 0, 0].item() == 1.0  # the truncated step's final observation
    assert b.discount[0, 0].item() == pytest.approx(0.25)


def test_windows_shorten_at_the_end_of_the_chunk():
    b = nstep_returns(chunk(4, 1), gamma=0.5, nstep=3)
    assert b.reward[3, 0].item() == pytest.approx(4.0)
    assert b.discount[3, 0].item() == pytest.approx(0.5)
    assert b.reward[2, 0].item() == pytest.approx(3 + 0.5 * 4)


def test_envs_are_independent():
    b = nstep_returns(chunk(3, 2, terminated=[(0, 0)]), gamma=1.0, nstep=3)
    assert b.reward[0, 0].item() == 1.0               # env 0 terminated at once
    assert b.reward[0, 1].item() == 2.0 + 4.0 + 6.0   # env 1 runs the whole window


def test_one_step_leaves_rewards_alone():
    b = nstep_returns(chunk(3, 2), gamma=0.9, nstep=1)
    assert torch.equal(b.reward, torch.arange(1.0, 7.0).reshape(3, 2))
    assert torch.allclose(b.discount, torch.full((3, 2), 0.9))


def test_nested_next_observations_are_gathered_per_leaf():
    b = chunk(3, 1)
    b.next_obs = ttorch.Tensor({"pos": torch.arange(3.0).reshape(3, 1, 1), "img": torch.arange(3.0).reshape(3, 1, 1)})
    out = nstep_returns(b, gamma=0.5, nstep=2)
    assert out.next_obs.pos[0, 0, 0].item() == 1.0 and out.next_obs.img[1, 0, 0].item() == 2.0


def test_flat_batches_are_rejected_with_the_expected_layout():
    with pytest.raises(ValueError, match=r"time-major batch \[T, N\]"):
        nstep_returns(ttorch.Tensor({"reward": torch.zeros(5), "terminated": torch.zeros(5, dtype=torch.bool),
                                     "truncated": torch.zeros(5, dtype=torch.bool)}), 0.9, 3)
