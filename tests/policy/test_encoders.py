"""Encoders chosen by policy.model.encoder: every policy family builds, acts and learns on uint8 images."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch

from conveyor.policy import (BCPolicy, ConvEncoder, CQLPolicy, DiscreteCQLPolicy, DQNPolicy, FlattenMLP, ImpalaCNN,
                             IQLPolicy, NatureCNN, PPOPolicy, SACPolicy, TD3Policy, build_encoder)
from conveyor.schema import ConfigError

IMAGE = (4, 36, 36)  # the smallest side the Nature CNN takes, to keep these tests fast
N = 8


def images(g: torch.Generator, n: int = N) -> torch.Tensor:
    return torch.randint(0, 256, (n, *IMAGE), generator=g, dtype=torch.uint8)


def discrete_batch(g: torch.Generator) -> dict:
    return {"obs": images(g), "next_obs": images(g), "action": torch.randint(0, 3, (N,), generator=g),
            "reward": torch.randn(N, generator=g), "terminated": torch.zeros(N, dtype=torch.bool),
            "truncated": torch.zeros(N, dtype=torch.bool)}


def continuous_batch(g: torch.Generator) -> dict:
    return {**discrete_batch(g), "action": torch.rand(N, 2, generator=g) * 2 - 1}


def ppo_batch(g: torch.Generator, policy: PPOPolicy) -> dict:
    obs = images(g)
    out = policy.collect_mode.forward(obs.numpy())
    return {"obs": obs, "action": torch.from_numpy(out["action"]), "logp": torch.from_numpy(out["logp"]),
            "value": torch.from_numpy(out["value"]), "adv": torch.randn(N, generator=g),
            "return": torch.randn(N, generator=g), "reward": torch.zeros(N)}


FAMILIES = {
    "dqn": (DQNPolicy, {"action_shape": 3}, discrete_batch),
    "discrete_cql": (DiscreteCQLPolicy, {"action_shape": 3}, discrete_batch),
    "ppo": (PPOPolicy, {"action_shape": 3}, None),
    "ppo_shared": (PPOPolicy, {"action_shape": 3, "share_encoder": True}, None),
    "ppo_gru": (PPOPolicy, {"action_shape": 3, "rnn": "gru", "rnn_hidden_size": 8}, None),
    "sac": (SACPolicy, {"action_shape": 2, "hidden_sizes": [16, 16]}, continuous_batch),
    "td3": (TD3Policy, {"action_shape": 2, "hidden_sizes": [16, 16]}, continuous_batch),
    "cql": (CQLPolicy, {"action_shape": 2, "hidden_sizes": [16, 16]}, continuous_batch),
    "iql": (IQLPolicy, {"action_shape": 2, "hidden_sizes": [16, 16]}, continuous_batch),
    "bc": (BCPolicy, {"action_shape": 3, "hidden_sizes": [16]}, discrete_batch),
}


def make(family: str, encoder: str):
    cls, model, _ = FAMILIES[family]
    return cls({"model": {"obs_shape": list(IMAGE), "encoder": encoder, **model}, "learn": {"batch_size": N}}, seed=0)


@pytest.mark.parametrize("encoder", ["auto", "mlp", "nature", "impala"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_policy_builds_acts_and_learns_on_uint8_images_with_each_encoder(family, encoder):
    policy = make(family, encoder)
    cnn = {"auto": ConvEncoder, "mlp": FlattenMLP, "nature": NatureCNN, "impala": ImpalaCNN}[encoder]
    assert any(isinstance(m, cnn) for m in policy.model.modules())
    g = torch.Generator().manual_seed(0)
    obs = images(g).numpy()
    if family == "ppo_gru":  # a recurrent policy learns from sequences; acting is what differs here
        assert policy.collect_mode.forward(obs)["action"].shape == (N,)
        assert policy.eval_mode.forward(obs)["action"].shape == (N,)
        return
    kwargs = {"eps": 0.1} if family in ("dqn", "discrete_cql") else {}
    assert len(policy.collect_mode.forward(obs, **kwargs)["action"]) == N
    assert len(policy.eval_mode.forward(obs)["action"]) == N
    before = [p.detach().clone() for p in policy.model.parameters()]
    make_batch = FAMILIES[family][2]
    batch = ttorch.Tensor(ppo_batch(g, policy) if make_batch is None else make_batch(g))
    metrics = policy.learn_mode.forward(batch).metrics
    assert all(math.isfinite(v) for v in metrics.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))


@pytest.mark.parametrize("kind, out_dim", [("nature", 512), ("impala", 256)])
def test_image_encoders_divide_uint8_pixels_by_255_inside_and_keep_leading_dims(kind, out_dim):
    torch.manual_seed(0)
    enc = build_encoder(IMAGE, [8], kind)
    pixels = torch.randint(0, 256, (2, 3, *IMAGE), dtype=torch.uint8)
    out = enc(pixels)
    assert out.shape == (2, 3, out_dim) == (2, 3, enc.output_dim)
    torch.testing.assert_close(out, enc(pixels.float() / 255.0))


def test_image_encoders_read_channels_last_images():
    torch.manual_seed(0)
    enc = build_encoder((36, 36, 3), [8], "nature")
    pixels = torch.randint(0, 256, (2, 36, 36, 3), dtype=torch.uint8)
    assert enc(pixels).shape == (2, 512)


def test_nature_encoder_has_the_nature_dqn_layers():
    enc = build_encoder((4, 84, 84), [8], "nature")
    convs = [m for m in enc.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride) for c in convs] == [(32, (8, 8), (4, 4)), (64, (4, 4), (2, 2)),
                                                                           (64, (3, 3), (1, 1))]
    linear = [m for m in enc.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(3136, 512)]


def test_impala_encoder_has_three_residual_stacks():
    enc = build_encoder((4, 84, 84), [8], "impala")
    convs = [m for m in enc.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 3 * 5 and [c.out_channels for c in convs[::5]] == [16, 32, 32]
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in enc.modules()) == 3
    linear = [m for m in enc.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(32 * 11 * 11, 256)]


def test_ppo_initialises_the_nature_cnn_orthogonally():
    policy = PPOPolicy({"model": {"obs_shape": [4, 84, 84], "action_shape": 4, "encoder": "nature",
                                  "share_encoder": True}}, seed=0)
    first = policy.model.actor_encoder.conv[0]
    w = first.weight.detach().reshape(first.weight.shape[0], -1)
    torch.testing.assert_close(w @ w.T, 2.0 * torch.eye(w.shape[0]), atol=1e-4, rtol=0)  # gain sqrt(2), rows
    assert not first.bias.any()


def test_mlp_encoder_flattens_images():
    policy = DQNPolicy({"model": {"obs_shape": [2, 3, 4], "action_shape": 2, "encoder": "mlp"}}, seed=0)
    assert policy.eval_mode.forward(np.zeros((5, 2, 3, 4), np.uint8))["action"].shape == (5,)


@pytest.mark.parametrize("obs_shape, encoder, fix", [
    (4, "nature", "encoder='mlp'"), ([4], "impala", "encoder='mlp'"), ([4, 20, 20], "nature", "encoder='impala'"),
])
def test_an_encoder_that_does_not_fit_the_observations_is_a_config_error_naming_the_fix(obs_shape, encoder, fix):
    with pytest.raises(ConfigError, match=f"policy.model.encoder.*{fix}"):
        DQNPolicy({"model": {"obs_shape": obs_shape, "action_shape": 2, "encoder": encoder}})


def test_an_unknown_encoder_is_a_config_error():
    with pytest.raises(ConfigError, match="encoder"):
        SACPolicy({"model": {"obs_shape": 3, "action_shape": 1, "encoder": "resnet"}})


@pytest.mark.parametrize("cls", [DQNPolicy, PPOPolicy, SACPolicy, TD3Policy, BCPolicy, CQLPolicy, IQLPolicy])
def test_every_policy_schema_has_the_encoder_option_defaulting_to_auto(cls):
    assert cls.default_config().model.encoder == "auto"
