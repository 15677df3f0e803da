"""IMPALA's actor-learner middleware: unrolls cut from trajectories, batches of them, weights on a schedule."""
import pickle

import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor import OnlineRLContext
from conveyor.middleware import unroll_cutter, unroll_learner
from tests.middleware.test_trainer import RecordingLearner, train


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
