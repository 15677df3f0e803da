"""IMPALA's actor-learner middleware: unrolls cut from trajectories, batches of them, weights on a schedule."""
import pickle

import pytest

import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor import OnlineRLContext
from conveyor.middleware import unroll_cutter, unroll_learner
from tests.middleware.test_on_policy import RecordingLearner, train


def learn_cfg(batch_size, publish_every):
    return EasyDict(seed=0, policy=dict(learn=dict(batch_size=batch_size, publish_every=publish_every)))


def unrolls(first, n, steps=3):
    """``n`` unrolls ``[n, steps]`` numbered ``first...`` in their ``obs``."""
    ids = torch.arange(first, first + n, dtype=torch.float32)
    return ttorch.Tensor({"obs": ids[:, None].expand(n, steps).clone(), "reward": torch.zeros(n, steps)})


def test_the_cutter_turns_time_major_trajectories_into_one_unroll_per_env():
    ctx = OnlineRLContext()
    obs = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # [T=4, N=3]: obs[t, n] = 3 t + n
    ctx.trajectories = ttorch.Tensor({"obs": obs, "reward": torch.zeros(4, 3)})
    ctx.trajectory_end_idx = [5]
    unroll_cutter()(ctx)
    assert ctx.trajectories is None and ctx.trajectory_end_idx is None
    assert ctx.train_data.obs.shape == (3, 4)
    assert ctx.train_data.obs[1].tolist() == [1.0, 4.0, 7.0, 10.0]  # env 1's steps in order


def test_each_unroll_is_learned_from_once_in_batches_of_batch_size_from_whichever_sends_came():
    learner = RecordingLearner()
    mw = unroll_learner(learn_cfg(batch_size=4, publish_every=100), learner)
    assert train(mw, unrolls(0, 3)).train_iter == 0 and mw.queued == 3  # not enough for a batch yet
    ctx = train(mw, unrolls(3, 6))  # e.g. two collectors' sends merged: 9 queued, two batches, one left
    assert ctx.train_iter == 2 and len(ctx.train_output) == 2 and ctx.train_data is None
    assert [b.obs[:, 0].tolist() for b in learner.batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mw.queued == 1
    train(mw, unrolls(9, 3))
    assert learner.batches[2].obs[:, 0].tolist() == [8, 9, 10, 11] and mw.queued == 0


def test_weights_are_published_every_publish_every_steps_not_after_every_batch():
    learner = RecordingLearner()
    mw = unroll_learner(learn_cfg(batch_size=2, publish_every=3), learner)
    for i in range(4):
        train(mw, unrolls(2 * i, 2))  # one batch per call
    assert learner.published_after == [3]
    for i in range(4, 7):
        train(mw, unrolls(2 * i, 2))
    assert learner.published_after == [3, 6]


def test_a_resumed_learner_goes_on_with_its_queue_and_publish_schedule():
    straight, split = RecordingLearner(), RecordingLearner()
    a = unroll_learner(learn_cfg(batch_size=4, publish_every=2), straight)
    b = unroll_learner(learn_cfg(batch_size=4, publish_every=2), split)
    sends = [unrolls(3 * i, 3) for i in range(6)]
    for data in sends[:3]:
        train(a, data)
        train(b, data)
    state = pickle.loads(pickle.dumps(b.state_dict()))
    b = unroll_learner(learn_cfg(batch_size=4, publish_every=2), split)
    b.load_state_dict(state)
    for data in sends[3:]:
        train(a, data)
        train(b, data)
    assert [x.obs.tolist() for x in straight.batches] == [x.obs.tolist() for x in split.batches]
    assert straight.published_after == split.published_after == [2, 4]


def replay_cfg(batch_size, replay_ratio, replay_size, publish_every=100):
    cfg = learn_cfg(batch_size, publish_every)
    cfg.policy.learn.update(replay_ratio=replay_ratio, replay_size=replay_size)
    return cfg


def test_without_a_replay_ratio_no_replay_is_kept_and_each_unroll_is_learned_from_once():
    learner = RecordingLearner()
    mw = unroll_learner(replay_cfg(batch_size=2, replay_ratio=0, replay_size=4), learner)
    ctx = train(mw, unrolls(0, 4))
    assert mw.replay is None and ctx.train_iter == 2
    assert [b.obs[:, 0].tolist() for b in learner.batches] == [[0, 1], [2, 3]]


def test_a_replay_ratio_of_k_takes_k_steps_on_replayed_unrolls_after_each_fresh_batch():
    learner = RecordingLearner()
    mw = unroll_learner(replay_cfg(batch_size=2, replay_ratio=3, replay_size=8), learner)
    ctx = train(mw, unrolls(0, 4))  # two fresh batches
    assert ctx.train_iter == 2 * (1 + 3) == len(ctx.train_output)
    fresh = [b.obs[:, 0].tolist() for b in learner.batches[::4]]
    assert fresh == [[0, 1], [2, 3]]
    for i, batch in enumerate(learner.batches):
        if i % 4:  # replayed: unrolls already learned from, whole and of batch_size
            learned = 2 * (i // 4 + 1)
            assert batch.obs.shape == (2, 3) and set(batch.obs[:, 0].tolist()) <= set(range(learned))
            assert (batch.obs == batch.obs[:, :1]).all()
            assert "index" not in batch


def test_the_replay_keeps_only_the_newest_replay_size_unrolls():
    learner = RecordingLearner()
    mw = unroll_learner(replay_cfg(batch_size=2, replay_ratio=1, replay_size=4), learner)
    for i in range(10):
        train(mw, unrolls(2 * i, 2))
    assert len(mw.replay) == 4
    last_replayed = learner.batches[-1].obs[:, 0].tolist()
    assert set(last_replayed) <= {16, 17, 18, 19}


def test_replayed_steps_count_towards_publish_every():
    learner = RecordingLearner()
    mw = unroll_learner(replay_cfg(batch_size=2, replay_ratio=2, replay_size=4, publish_every=2), learner)
    train(mw, unrolls(0, 4))  # 2 batches, 6 gradient steps
    assert learner.published_after == [2, 4, 6]


class LaggingLearner(RecordingLearner):
    """Reports the V-trace charts IMPALAPolicy does."""

    def forward(self, batch):
        super().forward(batch)
        return {"losses/x": 0.0, "charts/policy_lag": 1.0, "charts/policy_lag_max": 2.0, "charts/rho_mean": 0.9,
                "charts/rho_clip_frac": 0.1}


def test_replayed_steps_report_their_lag_apart_from_the_collectors_lag():
    mw = unroll_learner(replay_cfg(batch_size=2, replay_ratio=1, replay_size=4), LaggingLearner())
    fresh, replayed = train(mw, unrolls(0, 2)).train_output
    assert set(fresh) == {"losses/x", "charts/policy_lag", "charts/policy_lag_max", "charts/rho_mean",
                          "charts/rho_clip_frac"}
    assert replayed == {"losses/x": 0.0, "charts/replay_policy_lag": 1.0, "charts/replay_policy_lag_max": 2.0,
                        "charts/replay_rho_mean": 0.9, "charts/replay_rho_clip_frac": 0.1}


def test_a_resumed_learner_replays_what_the_uninterrupted_one_does():
    cfg = replay_cfg(batch_size=2, replay_ratio=2, replay_size=6, publish_every=3)
    straight, split = RecordingLearner(), RecordingLearner()
    a, b = unroll_learner(cfg, straight), unroll_learner(cfg, split)
    sends = [unrolls(3 * i, 3) for i in range(8)]
    for data in sends[:4]:
        train(a, data)
        train(b, data)
    state = pickle.loads(pickle.dumps(b.state_dict()))
    b = unroll_learner(cfg, split)
    b.load_state_dict(state)
    assert len(b.replay) == len(a.replay) == 6
    for data in sends[4:]:
        train(a, data)
        train(b, data)
    assert [x.obs.tolist() for x in straight.batches] == [x.obs.tolist() for x in split.batches]
    assert straight.published_after == split.published_after


def test_a_checkpoint_without_a_replay_is_refused_by_a_learner_that_replays():
    plain = unroll_learner(learn_cfg(batch_size=2, publish_every=1), RecordingLearner())
    replaying = unroll_learner(replay_cfg(batch_size=2, replay_ratio=1, replay_size=4), RecordingLearner())
    with pytest.raises(ValueError, match="replay_ratio"):
        replaying.load_state_dict(plain.state_dict())


@pytest.mark.parametrize("key, value", [("replay_ratio", -1), ("replay_ratio", 1.5), ("replay_size", 0)])
def test_a_bad_replay_option_is_refused_with_its_config_path(key, value):
    cfg = replay_cfg(batch_size=2, replay_ratio=1, replay_size=4)
    cfg.policy.learn[key] = value
    with pytest.raises(ValueError, match=f"cfg.policy.learn.{key}"):
        unroll_learner(cfg, RecordingLearner())
