"""Versioned weights: acting reads published immutable copies, never the weights a learner is updating."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from torch import nn

from conveyor.policy import DQNPolicy, Policy, PPOPolicy

from policy_testing import through_bytes


class Constant(nn.Module):
    """Parameters and a buffer that a learning step sets, one tensor after another, to one constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(2, 2))
        self.register_buffer("c", torch.zeros(1))


class ConstantPolicy(Policy):
    """Learning step k sets every weight to k; acting reports every weight it read, one tensor at a time.

    ``between_reads`` (if set) runs after an acting hook has read the first tensor and before the rest: the
    moment a reader of live weights would see a torn update.
    """

    between_reads = None

    @classmethod
    def build_model(cls, model_cfg) -> nn.Module:
        return Constant()

    def _forward_learn(self, batch):
        self.train_iter += 1
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tensor.fill_(float(self.train_iter))
        return {}

    def _read(self, acting, obs):
        tensors = [*acting.model.parameters(), *acting.model.buffers()]
        seen = [float(tensors[0].flatten()[0])]
        if self.between_reads is not None:
            self.between_reads()
        seen += [float(v) for t in tensors for v in t.flatten()]
        return {"action": np.zeros(len(obs), np.int64), "seen": seen}

    def _forward_collect(self, acting, obs, **kwargs):
        return self._read(acting, obs)

    def _forward_eval(self, acting, obs):
        return self._read(acting, obs)


def constant_policy() -> ConstantPolicy:
    return ConstantPolicy({"model": {}})


def learn(policy: Policy) -> None:
    policy.learn_mode.forward({"reward": np.zeros(1, np.float32)})


OBS = np.zeros((2, 1), np.float32)


def test_the_initial_weights_are_version_0_and_each_publish_numbers_the_next():
    policy = constant_policy()
    assert policy.version == 0 == policy.collect_mode.version == policy.eval_mode.version
    learn(policy)
    assert policy.learn_mode.publish() == 1 == policy.version
    assert policy.publish() == 2


def test_acting_does_not_see_updates_until_they_are_published():
    policy = constant_policy()
    learn(policy)
    learn(policy)
    assert set(policy.eval_mode.forward(OBS)["seen"]) == {0.0}
    policy.learn_mode.publish()
    assert set(policy.eval_mode.forward(OBS)["seen"]) == {2.0}


def test_collect_output_records_the_version_of_each_env():
    policy = constant_policy()
    learn(policy)
    policy.publish()
    out = policy.collect_mode.forward(np.zeros((3, 1), np.float32))
    assert out["weight_version"].dtype == np.int64
    np.testing.assert_array_equal(out["weight_version"], [1, 1, 1])


@pytest.mark.parametrize("mode", ["collect", "eval"])
def test_a_forward_sees_one_version_while_another_thread_learns_and_publishes_in_its_middle(mode):
    policy = constant_policy()
    mid_read, published = threading.Event(), threading.Event()

    def between_reads():
        mid_read.set()
        assert published.wait(timeout=10)

    def learner():
        assert mid_read.wait(timeout=10)
        learn(policy)  # writes every tensor of the live model in place
        policy.publish()
        published.set()

    policy.between_reads = between_reads
    thread = threading.Thread(target=learner)
    thread.start()
    out = getattr(policy, f"{mode}_mode").forward(OBS)
    thread.join()
    assert set(out["seen"]) == {0.0}  # all of version 0, though version 1 was written meanwhile
    policy.between_reads = None
    assert set(policy.eval_mode.forward(OBS)["seen"]) == {1.0}


def test_readers_in_one_thread_see_whole_versions_while_a_learner_thread_steps():
    policy = constant_policy()
    start = threading.Barrier(2, timeout=10)
    done = threading.Event()
    seen = []

    def learner():
        start.wait()
        for _ in range(300):
            learn(policy)
            policy.publish()
        done.set()

    def reader():
        start.wait()
        while not done.is_set():
            out = policy.collect_mode.forward(OBS)
            seen.append((set(out["seen"]), int(out["weight_version"][0])))
            seen.append((set(policy.eval_mode.forward(OBS)["seen"]), None))

    threads = [threading.Thread(target=learner), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen
    for values, version in seen:
        assert len(values) == 1  # one consistent version per forward
        if version is not None:
            assert values == {float(version)}  # and the one it reports


def test_a_snapshot_keeps_acting_on_its_version_while_newer_ones_are_published():
    policy = constant_policy()
    learn(policy)
    policy.publish()
    snapshot = policy.eval_mode.snapshot()
    for _ in range(5):  # enough publishes to recycle every unpinned copy
        learn(policy)
        policy.publish()
    assert snapshot.version == 1 and policy.version == 6
    assert set(snapshot.forward(OBS)["seen"]) == {1.0}
    assert set(policy.eval_mode.forward(OBS)["seen"]) == {6.0}
    collect = policy.collect_mode.snapshot()
    np.testing.assert_array_equal(collect.forward(OBS)["weight_version"], [6, 6])


def test_a_snapshots_checkpoint_holds_its_versions_weights_and_loads_as_that_version():
    policy = constant_policy()
    learn(policy)
    policy.publish()
    snapshot = policy.eval_mode.snapshot()
    learn(policy)
    learn(policy)
    state = snapshot.state_dict()
    assert all(torch.equal(t, torch.ones_like(t)) for t in state["model"].values())
    assert state["counters"] == {"train_iter": 3, "version": 1}
    restored = constant_policy()
    restored.load_state_dict(through_bytes(state))
    assert restored.version == 1
    assert set(restored.eval_mode.forward(OBS)["seen"]) == {1.0}


def test_loading_a_checkpoint_publishes_its_weights_under_the_saved_version_number():
    policy = constant_policy()
    for _ in range(3):
        learn(policy)
        policy.publish()
    restored = constant_policy()
    restored.load_state_dict(policy.state_dict())
    assert restored.version == 3
    assert set(restored.eval_mode.forward(OBS)["seen"]) == {3.0}
    learn(restored)
    assert restored.publish() == 4


def test_recurrent_snapshots_and_views_keep_their_own_hidden_state():
    policy = PPOPolicy({"model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [8], "rnn": "gru",
                                  "rnn_hidden_size": 4}}, seed=0)
    obs = np.random.default_rng(0).normal(size=(3, 2)).astype(np.float32)
    for _ in range(3):
        policy.eval_mode.forward(obs)  # the eval view's state moves on
    fresh = policy.eval_mode.snapshot()
    first = fresh.forward(obs)["action"]
    policy.eval_mode.reset()
    np.testing.assert_array_equal(policy.eval_mode.forward(obs)["action"], first)  # same start, same weights
    collected = policy.collect_mode.forward(obs)
    np.testing.assert_array_equal(collected["hidden"], np.zeros((3, 4), np.float32))  # collect state untouched
    np.testing.assert_array_equal(collected["weight_version"], [0, 0, 0])


def test_publishing_does_not_share_storage_with_the_learning_model():
    policy = DQNPolicy({"model": {"obs_shape": 4, "action_shape": 2, "hidden_sizes": [8]}}, seed=0)
    obs = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    before = policy.eval_mode.forward(obs)["action"]
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(-1.0)  # the learner's weights change in place
    np.testing.assert_array_equal(policy.eval_mode.forward(obs)["action"], before)
    policy.publish()
    assert not np.array_equal(policy.eval_mode.forward(obs)["action"], before)


def test_learning_steps_keep_numbering_and_the_learner_checkpoint_consistent():
    policy = DQNPolicy({"model": {"obs_shape": 4, "action_shape": 2, "hidden_sizes": [8]}}, seed=0)
    batch = ttorch.Tensor({"obs": torch.randn(8, 4), "action": torch.zeros(8, dtype=torch.long),
                           "reward": torch.ones(8), "next_obs": torch.randn(8, 4),
                           "terminated": torch.zeros(8, dtype=torch.bool),
                           "truncated": torch.zeros(8, dtype=torch.bool)})
    policy.learn_mode.forward(batch)
    policy.learn_mode.publish()
    state = policy.state_dict()
    assert state["counters"] == {"train_iter": 1, "version": 1}
