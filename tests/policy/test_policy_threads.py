"""A policy shared by a learner thread and a checkpointing thread, as in an async pipeline."""
import threading

import numpy as np
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor.policy import DQNPolicy


def batch(n=32):
    return ttorch.Tensor({"obs": torch.randn(n, 4), "action": torch.randint(0, 2, (n,)), "reward": torch.ones(n),
                          "next_obs": torch.randn(n, 4), "terminated": torch.zeros(n, dtype=torch.bool),
                          "truncated": torch.zeros(n, dtype=torch.bool)})


def test_state_dict_taken_during_training_is_a_consistent_snapshot():
    policy = DQNPolicy(EasyDict(model=dict(obs_shape=4, action_shape=2, hidden_sizes=[16])))
    start = threading.Barrier(2, timeout=10)
    snapshots = []

    def learner():
        start.wait()
        for _ in range(200):
            policy.learn_mode.forward(batch())

    def saver():
        start.wait()
        for _ in range(50):
            snapshots.append(policy.state_dict())

    threads = [threading.Thread(target=learner), threading.Thread(target=saver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for state in snapshots:
        step = state["counters"]["train_iter"]
        adam_steps = [float(s["step"]) for s in state["optimizer"]["state"].values()] or [0.0]
        assert all(a == step for a in adam_steps)  # optimizer and counter saved at the same update


def test_state_dict_is_a_copy_not_live_tensors():
    policy = DQNPolicy(EasyDict(model=dict(obs_shape=4, action_shape=2, hidden_sizes=[16])))
    state = policy.state_dict()
    before = {k: v.clone() for k, v in state["model"].items()}
    policy.learn_mode.forward(batch())
    assert all(torch.equal(before[k], v) for k, v in state["model"].items())
    assert np.isfinite(policy.learn_mode.train_iter)
