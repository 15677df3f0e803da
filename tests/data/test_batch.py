"""Batch helpers: stacking nested arrays and turning them into ttorch trees of tensors."""
import numpy as np
import pytest
import torch

from conveyor.data import stack_nested, to_numpy, to_tensor


def test_stack_nested_stacks_every_leaf_along_a_new_leading_axis():
    items = [{"obs": {"pos": np.full((2, 3), i, np.float32)}, "done": np.array([i % 2 == 0] * 2)} for i in range(4)]
    out = stack_nested(items)
    assert out["obs"]["pos"].shape == (4, 2, 3) and out["obs"]["pos"].dtype == np.float32
    assert out["obs"]["pos"][:, 0, 0].tolist() == [0, 1, 2, 3]
    assert out["done"].dtype == np.bool_ and out["done"][:, 0].tolist() == [True, False, True, False]
    assert stack_nested([np.zeros(2), np.ones(2)], axis=1).shape == (2, 2)


def test_stack_nested_refuses_arrays_of_different_shapes():
    with pytest.raises(ValueError):
        stack_nested([np.zeros(3), np.zeros(4)])


def test_to_tensor_builds_a_tree_for_dicts_and_casts_float64_to_float32():
    tree = to_tensor({"obs": {"pos": np.zeros((2, 3))}, "action": np.array([1, 0])})
    assert tree.obs.pos.dtype == torch.float32 and tree.action.dtype == torch.int64
    back = to_numpy(tree)
    assert back["obs"]["pos"].shape == (2, 3) and back["action"].tolist() == [1, 0]
    assert isinstance(to_tensor(np.ones(3, np.float32)), torch.Tensor)
