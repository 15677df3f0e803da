"""DequeBuffer misuse: each error says what was wrong, where, and how to fix it."""
import numpy as np
import pytest
import torch

from conveyor.data import DequeBuffer


@pytest.mark.parametrize("kwargs, message", [
    ({"size": 0}, "size must be a positive int"),
    ({"size": -3}, "size must be a positive int"),
    ({"size": 2.5}, "size must be a positive int"),
    ({"size": 4, "alpha": 1.5}, r"alpha must be a number in \[0, 1\]"),
    ({"size": 4, "beta": -0.1}, r"beta must be a number in \[0, 1\]"),
    ({"size": 4, "eps": -1e-6}, "eps must be a finite number >= 0"),
    ({"size": 4, "seed": "abc"}, "seed must be None or an int"),
])
def test_bad_constructor_arguments_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DequeBuffer(**kwargs)


def test_setting_beta_out_of_range_is_rejected():
    buffer = DequeBuffer(4, prioritized=True)
    with pytest.raises(ValueError, match="beta must be"):
        buffer.beta = 2.0


def test_sampling_an_empty_buffer_says_to_add_transitions():
    with pytest.raises(ValueError, match=r"empty; push\(\) or extend\(\)"):
        DequeBuffer(4).sample(1)


@pytest.mark.parametrize("n", [0, -1, 2.0])
def test_sampling_a_non_positive_count_is_rejected(n):
    buffer = DequeBuffer(4)
    buffer.push({"a": 1})
    with pytest.raises(ValueError, match="n must be a positive int"):
        buffer.sample(n)


def test_a_missing_or_extra_key_is_named():
    buffer = DequeBuffer(4)
    buffer.push({"obs": {"x": np.zeros(2), "y": np.zeros(2)}, "action": 0})
    with pytest.raises(ValueError, match=r"missing \['obs.y'\]; unexpected \['obs.z'\]"):
        buffer.push({"obs": {"x": np.zeros(2), "z": np.zeros(2)}, "action": 0})


def test_a_shape_change_is_named_with_both_shapes():
    buffer = DequeBuffer(4)
    buffer.push({"obs": np.zeros(4), "action": 0})
    with pytest.raises(ValueError, match=r"key 'obs' has shape \(3,\), but the buffer stores \(4,\)"):
        buffer.push({"obs": np.zeros(3), "action": 0})


def test_extending_a_time_major_batch_suggests_flatten_batch():
    buffer = DequeBuffer(16)
    buffer.extend({"obs": np.zeros((2, 4))})
    with pytest.raises(ValueError, match=r"flatten_batch"):
        buffer.extend({"obs": np.zeros((3, 2, 4))})


def test_a_float_written_into_an_int_key_is_rejected():
    buffer = DequeBuffer(4)
    buffer.push({"action": 1})
    with pytest.raises(ValueError, match=r"key 'action' holds float32 data, but the buffer stores int64"):
        buffer.push({"action": 1.5})


def test_extend_rejects_leaves_of_different_lengths():
    with pytest.raises(ValueError, match=r"different leading \(batch\) dims \(obs: 3, action: 2\)"):
        DequeBuffer(4).extend({"obs": np.zeros((3, 2)), "action": np.zeros(2)})


def test_extend_rejects_a_scalar_leaf():
    with pytest.raises(ValueError, match=r"key 'reward' is a scalar; extend\(\) takes a batch"):
        DequeBuffer(4).extend({"obs": np.zeros((3, 2)), "reward": 1.0})


def test_extend_rejects_a_list_of_transitions():
    with pytest.raises(TypeError, match=r"not a list of transitions: stack them"):
        DequeBuffer(4).extend([{"a": 1}, {"a": 2}])


def test_push_rejects_something_that_is_not_a_dict():
    with pytest.raises(TypeError, match="takes a dict of arrays"):
        DequeBuffer(4).push(np.zeros(3))


def test_non_numeric_data_is_rejected():
    with pytest.raises(TypeError, match="key 'name' holds <U5 data"):
        DequeBuffer(4).push({"name": np.array("hello")})


def test_reserved_keys_are_rejected():
    with pytest.raises(ValueError, match=r"\['index'\] are reserved"):
        DequeBuffer(4).push({"obs": 0, "index": 3})


def test_a_rejected_first_push_does_not_fix_the_layout():
    buffer = DequeBuffer(4)
    with pytest.raises(ValueError):
        buffer.extend({"obs": np.zeros((3, 2)), "reward": np.zeros(2)})
    buffer.push({"other": 1.0})
    assert buffer.sample(1).other.shape == (1,)


def test_update_priority_on_a_uniform_buffer_says_how_to_enable_it():
    buffer = DequeBuffer(4)
    buffer.push({"a": 1})
    with pytest.raises(ValueError, match=r"prioritized=True"):
        buffer.update_priority([0], [1.0])


def test_update_priority_rejects_an_index_outside_the_stored_transitions():
    buffer = DequeBuffer(4, prioritized=True)
    buffer.push({"a": 1})
    with pytest.raises(ValueError, match=r"index out of range \[0, 1\)"):
        buffer.update_priority(torch.tensor([1]), torch.tensor([1.0]))


@pytest.mark.parametrize("priority", [-1.0, float("nan"), float("inf")])
def test_update_priority_rejects_negative_or_non_finite_priorities(priority):
    buffer = DequeBuffer(4, prioritized=True)
    buffer.push({"a": 1})
    with pytest.raises(ValueError, match="priorities must be finite and >= 0"):
        buffer.update_priority([0], [priority])


def test_update_priority_rejects_mismatched_lengths():
    buffer = DequeBuffer(4, prioritized=True)
    buffer.extend({"a": np.arange(3)})
    with pytest.raises(ValueError, match="got 2 indices but 3 priorities"):
        buffer.update_priority([0, 1], [1.0, 2.0, 3.0])


def test_sampling_when_every_priority_is_zero_says_to_use_eps():
    buffer = DequeBuffer(4, prioritized=True, eps=0.0)
    buffer.extend({"a": np.arange(2)})
    buffer.update_priority([0, 1], [0.0, 0.0])
    with pytest.raises(ValueError, match="every priority is 0"):
        buffer.sample(1)
