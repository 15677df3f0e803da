"""to_tensor / to_device: one host-to-device copy per leaf, through pinned memory when the target is CUDA."""
import numpy as np
import pytest
import torch
import treetensor.torch as ttorch

from conveyor.data import to_device, to_tensor



def batch():
    rng = np.random.default_rng(0)
    return {"obs": rng.integers(0, 256, (8, 4, 84, 84), dtype=np.uint8), "reward": rng.standard_normal(8),
            "next": {"action": np.arange(8)}}


def test_to_a_cpu_device_nothing_is_pinned_or_changed():
    out = to_tensor(batch(), "cpu")
    assert not out.obs.is_pinned() and out.obs.dtype == torch.uint8 and out.reward.dtype == torch.float32
    assert torch.equal(out.obs, torch.from_numpy(batch()["obs"]))
    tensor = torch.arange(3)
    assert to_device(tensor, torch.device("cpu")) is tensor


@pytest.mark.cuda
@pytest.mark.parametrize("as_tree", [False, True], ids=["dict", "ttorch"])
def test_to_cuda_every_leaf_goes_through_pinned_memory_once(monkeypatch, as_tree):
    pinned = []
    pin_memory = torch.Tensor.pin_memory

    def spy(self, *args, **kwargs):
        pinned.append(tuple(self.shape))
        return pin_memory(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "pin_memory", spy)
    data = to_tensor(batch()) if as_tree else batch()
    out = to_tensor(data, "cuda")
    torch.cuda.synchronize()
    assert sorted(pinned) == sorted([(8, 4, 84, 84), (8,), (8,)])
    assert isinstance(out, ttorch.Tensor) and out.obs.device.type == "cuda" and out.obs.dtype == torch.uint8
    assert torch.equal(out.obs.cpu(), torch.from_numpy(batch()["obs"]))
    assert torch.equal(out.next.action.cpu(), torch.arange(8))
    assert out.reward.dtype == torch.float32


@pytest.mark.cuda
def test_an_already_pinned_tensor_is_not_pinned_again(monkeypatch):
    tensor = torch.arange(6.0).pin_memory()
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pytest.fail("pinned twice"))
    out = to_device(tensor, torch.device("cuda"))
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.arange(6.0))
