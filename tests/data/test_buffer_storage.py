"""DequeBuffer storage: FIFO order, the ring, nested layouts, dtypes and input types."""
import numpy as np
import torch
import treetensor.torch as ttorch

from conveyor.data import DequeBuffer


def transition(i: int) -> dict:
    return {"obs": np.full(3, i, dtype=np.float32), "action": np.int64(i), "reward": np.float32(i)}


def batch(start: int, n: int) -> dict:
    ids = np.arange(start, start + n)
    return {"obs": np.repeat(ids[:, None], 3, axis=1).astype(np.float32), "action": ids,
            "reward": ids.astype(np.float32)}


def stored_actions(buffer: DequeBuffer) -> set[int]:
    """The set of actions held, read by sampling every slot many times over."""
    return set(buffer.sample(50 * buffer.size).action.tolist())


def test_sample_returns_a_tree_with_leading_dim_n_and_the_slots_index():
    buffer = DequeBuffer(8, seed=0)
    for i in range(5):
        buffer.push(transition(i))
    sample = buffer.sample(16)
    assert isinstance(sample, ttorch.Tensor)
    assert sample.obs.shape == (16, 3) and sample.action.shape == (16,) and sample.reward.shape == (16,)
    assert sample.index.dtype == torch.int64
    assert "weight" not in sample.keys()


def test_sampled_rows_match_the_transitions_at_their_index():
    buffer = DequeBuffer(8, seed=0)
    for i in range(8):
        buffer.push(transition(10 + i))
    sample = buffer.sample(32)
    assert torch.equal(sample.action, sample.index + 10)
    assert torch.equal(sample.obs[:, 0], sample.reward)


def test_push_beyond_capacity_evicts_the_oldest_first():
    buffer = DequeBuffer(5, seed=0)
    for i in range(7):
        buffer.push(transition(i))
    assert len(buffer) == 5
    assert stored_actions(buffer) == {2, 3, 4, 5, 6}


def test_extend_wraps_around_the_ring_keeping_fifo_order():
    buffer = DequeBuffer(5, seed=0)
    buffer.extend(batch(0, 3))
    buffer.extend(batch(3, 4))  # slots 3, 4, then wraps to 0, 1
    assert stored_actions(buffer) == {2, 3, 4, 5, 6}
    buffer.push(transition(7))  # evicts 2, the oldest left
    assert stored_actions(buffer) == {3, 4, 5, 6, 7}


def test_extend_larger_than_capacity_keeps_the_newest():
    buffer = DequeBuffer(4, seed=0)
    buffer.push(transition(100))
    buffer.extend(batch(0, 10))
    assert len(buffer) == 4
    assert stored_actions(buffer) == {6, 7, 8, 9}
    buffer.push(transition(10))  # the next eviction is still the oldest: 6
    assert stored_actions(buffer) == {7, 8, 9, 10}


def test_extend_with_zero_rows_changes_nothing():
    buffer = DequeBuffer(4, seed=0)
    buffer.extend(batch(0, 2))
    buffer.extend(batch(5, 0))
    assert len(buffer) == 2
    assert stored_actions(buffer) == {0, 1}


def test_nested_dict_observations_round_trip():
    buffer = DequeBuffer(4, seed=0)
    for i in range(4):
        buffer.push({"obs": {"image": np.full((2, 2), i, dtype=np.uint8), "state": {"pos": np.full(2, i * 0.5)}},
                     "action": i})
    sample = buffer.sample(20)
    assert sample.obs.image.shape == (20, 2, 2) and sample.obs.state.pos.shape == (20, 2)
    assert torch.equal(sample.obs.image[:, 0, 0].long(), sample.action)
    assert torch.equal(sample.obs.state.pos[:, 1], sample.action * 0.5)


def test_tuple_observations_are_stored_as_dicts_keyed_by_position():
    buffer = DequeBuffer(2, seed=0)
    buffer.push({"obs": (np.zeros(2, np.float32), np.ones(3, np.float32)), "action": 0})
    sample = buffer.sample(1)
    assert sample.obs["0"].shape == (1, 2) and sample.obs["1"].shape == (1, 3)


def test_dtypes_of_the_first_data_are_preserved():
    buffer = DequeBuffer(3, seed=0)
    buffer.push({"image": np.zeros((2, 2), np.uint8), "action": np.int32(1), "terminated": True,
                 "value": np.zeros(2, np.float64), "reward": 1.5, "count": 3})
    sample = buffer.sample(2)
    assert sample.image.dtype == torch.uint8
    assert sample.action.dtype == torch.int32
    assert sample.terminated.dtype == torch.bool
    assert sample.value.dtype == torch.float64
    assert sample.reward.dtype == torch.float32  # a Python float is stored as float32
    assert sample.count.dtype == torch.int64


def test_later_data_is_cast_to_the_stored_dtype_within_its_kind():
    buffer = DequeBuffer(2, seed=0)
    buffer.push({"reward": np.float32(0.0), "action": np.int64(0)})
    buffer.push({"reward": np.float64(2.0), "action": 1})
    sample = buffer.sample(8)
    assert sample.reward.dtype == torch.float32 and sample.action.dtype == torch.int64
    assert set(zip(sample.action.tolist(), sample.reward.tolist())) <= {(0, 0.0), (1, 2.0)}


def test_push_accepts_torch_tensors_and_a_ttorch_tree():
    buffer = DequeBuffer(4, seed=0)
    buffer.push({"obs": torch.ones(3), "action": torch.tensor(1)})
    buffer.push(ttorch.Tensor({"obs": torch.ones(3) * 2, "action": torch.tensor(2)}))
    sample = buffer.sample(16)
    assert sample.obs.dtype == torch.float32
    assert torch.equal(sample.obs[:, 0].long(), sample.action)


def test_extend_accepts_a_ttorch_batch():
    buffer = DequeBuffer(4, seed=0)
    buffer.extend(ttorch.Tensor({"obs": {"pos": torch.arange(3.0)[:, None].repeat(1, 2)}, "action": torch.arange(3)}))
    sample = buffer.sample(16)
    assert torch.equal(sample.obs.pos[:, 0].long(), sample.action)


def test_a_sampled_batch_can_be_extended_into_another_buffer_without_its_index():
    source = DequeBuffer(4, seed=0)
    source.extend(batch(0, 4))
    sample = source.sample(3)
    target = DequeBuffer(4, seed=0)
    target.extend({"obs": sample.obs, "action": sample.action, "reward": sample.reward})
    assert len(target) == 3


def test_sampled_batches_do_not_alias_the_storage():
    buffer = DequeBuffer(2, seed=0)
    buffer.extend(batch(0, 2))
    sample = buffer.sample(4)
    sample.obs += 100
    assert buffer.sample(64).obs.max() < 100


def test_uniform_sampling_draws_every_slot_about_equally():
    buffer = DequeBuffer(10, seed=0)
    buffer.extend(batch(0, 10))
    counts = np.bincount(buffer.sample(20_000).index.numpy(), minlength=10)
    assert np.allclose(counts / 20_000, 0.1, atol=0.01)


def test_same_seed_gives_the_same_samples():
    first, second = DequeBuffer(10, seed=3), DequeBuffer(10, seed=3)
    first.extend(batch(0, 10))
    second.extend(batch(0, 10))
    assert torch.equal(first.sample(32).index, second.sample(32).index)


def test_clear_empties_the_buffer_and_accepts_a_new_layout():
    buffer = DequeBuffer(4, seed=0)
    buffer.extend(batch(0, 3))
    buffer.clear()
    assert len(buffer) == 0
    buffer.push({"other": np.zeros(5)})
    assert buffer.sample(2).other.shape == (2, 5)
