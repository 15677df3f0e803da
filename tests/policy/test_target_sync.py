"""Target networks: Polyak averaging and hard copies through TargetSync and the soft/hard_update helpers."""
import pytest
import torch
from torch import nn

from conveyor.policy import TargetSync, hard_update, make_target, soft_update


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_soft_moves_the_target_a_fraction_tau_toward_the_source_and_copies_buffers():
    source = net()
    target = make_target(source)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
        source[1].running_mean.fill_(3.0)
    before = flat(target)
    TargetSync(target, source).soft(0.25)
    assert torch.allclose(flat(target), 0.75 * before + 0.25 * flat(source))
    assert torch.equal(target[1].running_mean, source[1].running_mean)
    assert not any(p.requires_grad for p in target.parameters())


def test_hard_copies_and_the_sync_keeps_working_after_load_state_dict():
    source, other = net(), net()
    target = make_target(source)
    sync = TargetSync(target, source)
    source.load_state_dict(other.state_dict())
    sync.hard()
    assert torch.equal(flat(target), flat(other))


def test_module_level_helpers_match_the_class():
    source = net()
    a, b = make_target(source), make_target(source)
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(2.0)
    soft_update(a, source, 0.5)
    TargetSync(b, source).soft(0.5)
    assert torch.equal(flat(a), flat(b))
    hard_update(a, source)
    assert torch.equal(flat(a), flat(source))


def test_networks_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="make_target"):
        TargetSync(nn.Linear(3, 4), nn.Linear(3, 5))

