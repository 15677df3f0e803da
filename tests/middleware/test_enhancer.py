"""n-step returns against hand-computed cases, and across collection calls."""
import pickle

import pytest
import torch
import treetensor.torch as ttorch

from conveyor.middleware import NStepEnhancer, nstep_returns, nstep_reward_enhancer


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


# --- n-step across collection calls ------------------------------------------------------------------
def collected(T, N, seed=0, nested=False):
    """A long time-major run with episode ends, truncations and crashed rows; ``obs`` numbers every row."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(T, N, generator=g)
    terminated, truncated = u < 0.1, (u >= 0.1) & (u < 0.17)
    valid = torch.rand(T, N, generator=g) >= 0.08
    row_id = torch.arange(T * N).reshape(T, N)
    # the step before a crash is left unmarked: the enhancer applies the collector's rule itself
    next_obs = (row_id * 10).float().unsqueeze(-1)
    if nested:
        next_obs = ttorch.Tensor({"pos": next_obs, "img": -next_obs})
    return ttorch.Tensor({"obs": row_id, "action": row_id % 3, "weight_version": row_id // N,
                          "reward": torch.rand(T, N, generator=g), "next_obs": next_obs,
                          "terminated": terminated & valid, "truncated": truncated & valid, "valid": valid})


def run_chunked(batch, rows_per_call, gamma=0.9, nstep=3, enhancer=None):
    enhancer = enhancer or NStepEnhancer(gamma, nstep)
    parts = [enhancer.process(batch[t:t + rows_per_call]) for t in range(0, len(batch.reward), rows_per_call)]
    return parts, enhancer


def by_row(parts):
    """Every handed-out transition keyed by its first row's id, as plain Python values."""
    out = {}
    for part in parts:
        for i, row_id in enumerate(part.obs.tolist()):
            assert row_id not in out, "a transition was handed out twice"
            next_obs = part.next_obs
            out[row_id] = (part.reward[i].item(), part.discount[i].item(),
                           bool(part.terminated[i]), bool(part.truncated[i]), int(part.action[i]),
                           int(part.weight_version[i]),
                           tuple(v[i].flatten().tolist() for v in ([next_obs] if isinstance(next_obs, torch.Tensor)
                                                                   and not hasattr(next_obs, "items")
                                                                   else [next_obs.pos, next_obs.img])))
    return out


def matches(handed_out, expected):
    """The same transitions; rewards and discounts up to float32 rounding."""
    assert handed_out.keys() == expected.keys()
    for key, (reward, discount, *rest) in handed_out.items():
        assert (reward, discount) == pytest.approx(expected[key][:2], rel=1e-5), key
        assert rest == list(expected[key][2:]), key
    return True


def reference(batch, gamma, nstep):
    """A per-transition loop over the whole run: min(nstep, steps to the episode's end) steps each; windows
    still open at the end of the run are left out."""
    reward, valid = batch.reward, batch.valid
    term, trunc = batch.terminated, batch.truncated.clone()
    T, N = reward.shape
    for t in range(T - 1):
        trunc[t] |= valid[t] & ~valid[t + 1] & ~term[t]
    out = {}
    for n in range(N):
        for t in range(T):
            if not valid[t, n]:
                continue
            total, k = 0.0, 0
            while True:
                total += gamma ** k * reward[t + k, n].item()
                k += 1
                end = term[t + k - 1, n] or trunc[t + k - 1, n]
                if end or k == nstep:
                    break
                if t + k >= T:
                    k = None
                    break
            last = None if k is None else t + k - 1
            if last is None or (last == T - 1 and not (term[last, n] or trunc[last, n])):
                continue  # still open: the row after the window, which may crash, has not arrived
            next_obs = batch.next_obs
            leaves = [next_obs] if not hasattr(next_obs, "items") else [next_obs.pos, next_obs.img]
            out[int(batch.obs[t, n])] = (total, gamma ** k, bool(term[last, n]),
                                         bool(trunc[last, n]), int(batch.action[t, n]), int(batch.weight_version[t, n]),
                                         tuple(v[last, n].flatten().tolist() for v in leaves))
    return out


@pytest.mark.parametrize("rows_per_call", [1, 2, 4])
def test_chunked_collection_hands_out_the_same_transitions_as_one_long_call(rows_per_call):
    batch = collected(24, 3)
    long_call, _ = run_chunked(batch, 24)
    chunked, _ = run_chunked(batch, rows_per_call)
    assert by_row(chunked) == by_row(long_call)  # bit for bit
    assert matches(by_row(long_call), reference(batch, 0.9, 3))


@pytest.mark.parametrize("rows_per_call", [1, 2, 4])
def test_nested_observations_follow_the_windows_across_calls(rows_per_call):
    batch = collected(16, 2, seed=3, nested=True)
    assert by_row(run_chunked(batch, rows_per_call, gamma=0.5, nstep=2)[0]) == by_row(run_chunked(batch, 16, 0.5, 2)[0])
    assert matches(by_row(run_chunked(batch, rows_per_call, gamma=0.5, nstep=2)[0]), reference(batch, 0.5, 2))


def test_one_row_per_call_gets_full_windows():
    batch = chunk(6, 1)  # no episode end: every window is nstep long once its rows have arrived
    parts, _ = run_chunked(batch, 1, gamma=0.5, nstep=3)
    assert [len(p.reward) for p in parts] == [0, 0, 0, 1, 1, 1]  # final once the row after it has arrived
    assert parts[3].reward[0].item() == pytest.approx(1 + 0.5 * 2 + 0.25 * 3)
    assert parts[3].discount[0].item() == pytest.approx(0.125)
    assert parts[3].next_obs[0, 0].item() == 2.0


def test_an_episode_end_completes_a_window_at_once():
    batch = chunk(2, 1, terminated=[(1, 0)])
    parts, _ = run_chunked(batch, 1, gamma=0.5, nstep=3)
    assert [len(p.reward) for p in parts] == [0, 2]  # both windows end at the termination
    assert parts[1].reward.tolist() == pytest.approx([1 + 0.5 * 2, 2.0])
    assert parts[1].terminated.tolist() == [True, True]


def test_a_truncation_ends_the_window_and_still_bootstraps():
    batch = chunk(3, 1, truncated=[(1, 0)])
    parts, _ = run_chunked(batch, 1, gamma=0.5, nstep=3)
    first = parts[1]
    assert first.truncated.tolist() == [True, True] and first.terminated.tolist() == [False, False]
    assert first.next_obs[:, 0].tolist() == [1.0, 1.0]  # the truncated step's final observation
    assert first.discount.tolist() == pytest.approx([0.25, 0.5])


def test_a_crash_at_the_start_of_a_call_ends_the_carried_windows_as_truncated():
    batch = chunk(3, 1)
    batch.valid = torch.tensor([[True], [True], [False]])
    parts, _ = run_chunked(batch, 1, gamma=0.5, nstep=3)
    assert [len(p.reward) for p in parts] == [0, 0, 2]  # the crashed row itself is no transition
    assert parts[2].truncated.tolist() == [True, True]
    assert parts[2].reward.tolist() == pytest.approx([1 + 0.5 * 2, 2.0])
    assert parts[2].next_obs[:, 0].tolist() == [1.0, 1.0]


def test_resuming_from_the_state_dict_hands_out_what_an_uninterrupted_run_does():
    batch = collected(20, 3, seed=5)
    straight, _ = run_chunked(batch, 2)
    first, enhancer = run_chunked(batch[:10], 2)
    resumed = NStepEnhancer(0.9, 3)
    resumed.load_state_dict(pickle.loads(pickle.dumps(enhancer.state_dict())))
    rest, _ = run_chunked(batch[10:], 2, enhancer=resumed)
    assert by_row(first + rest) == by_row(straight)


def test_the_enhancer_in_a_pipeline_leaves_finished_transitions_for_the_pusher():
    from conveyor import OnlineRLContext
    from conveyor.data import DequeBuffer
    from conveyor.middleware import data_pusher
    from easydict import EasyDict
    cfg = EasyDict(policy=dict(discount_factor=0.9, nstep=3))
    enhancer, buffer = nstep_reward_enhancer(cfg), DequeBuffer(100)
    push = data_pusher(cfg, buffer)
    batch = collected(8, 2, seed=1)
    for t in range(0, 8, 2):
        ctx = OnlineRLContext()
        ctx.trajectories = batch[t:t + 2]
        enhancer(ctx)
        push(ctx)
    stored = buffer.state_dict()["storage"]
    assert len(buffer) == len(reference(batch, 0.9, 3))
    assert sorted(stored["obs"][:len(buffer)].tolist()) == sorted(reference(batch, 0.9, 3))
    assert "valid" not in stored


def test_a_batch_that_does_not_continue_the_carried_rows_is_refused():
    enhancer = NStepEnhancer(0.9, 3)
    enhancer.process(chunk(2, 2))
    with pytest.raises(ValueError, match="does not continue"):
        enhancer.process(chunk(2, 3))
