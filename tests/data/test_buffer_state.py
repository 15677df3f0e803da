"""DequeBuffer checkpoints: state_dict / load_state_dict restore exactly."""
import pickle

import numpy as np
import pytest
import torch

from conveyor.data import DequeBuffer


def used(prioritized: bool) -> DequeBuffer:
    buffer = DequeBuffer(6, prioritized=prioritized, seed=7)
    buffer.extend({"obs": {"x": np.arange(8, dtype=np.float32)[:, None]}, "action": np.arange(8)})
    if prioritized:
        sample = buffer.sample(4)
        buffer.update_priority(sample.index, np.arange(1.0, 5.0))
    return buffer


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_restored_buffer_samples_like_the_original(prioritized):
    original = used(prioritized)
    restored = DequeBuffer(6, prioritized=prioritized)
    restored.load_state_dict(pickle.loads(pickle.dumps(original.state_dict())))
    assert len(restored) == len(original)
    for a, b in [(original.sample(16), restored.sample(16)) for _ in range(3)]:
        assert all(torch.equal(x, y) for x, y in zip(a.values(), b.values()))


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_restored_buffer_continues_the_ring_where_the_original_was(prioritized):
    original = used(prioritized)
    restored = DequeBuffer(6, prioritized=prioritized)
    restored.load_state_dict(original.state_dict())
    for buffer in (original, restored):
        buffer.push({"obs": {"x": np.array([100.0], np.float32)}, "action": 100})
    assert torch.equal(original.sample(64).action, restored.sample(64).action)


def test_state_dict_is_a_snapshot_unchanged_by_later_pushes():
    buffer = used(False)
    state = buffer.state_dict()
    buffer.extend({"obs": {"x": np.full((6, 1), -1.0, np.float32)}, "action": np.full(6, -1)})
    restored = DequeBuffer(6)
    restored.load_state_dict(state)
    assert restored.sample(64).action.min() >= 0


def test_state_of_an_empty_buffer_round_trips():
    restored = DequeBuffer(3, prioritized=True)
    restored.load_state_dict(DequeBuffer(3, prioritized=True).state_dict())
    assert len(restored) == 0
    restored.push({"a": 1.0})
    assert restored.sample(2).a.shape == (2,)


def test_loading_a_state_from_a_different_size_says_how_to_fix_it():
    with pytest.raises(ValueError, match=r"size=6.*same size"):
        DequeBuffer(5).load_state_dict(used(False).state_dict())
