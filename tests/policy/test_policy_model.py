"""Encoders picked from observation shapes, and the Q-network heads."""
from __future__ import annotations

import pytest
import torch

from conveyor.policy import MLP, ConvEncoder, DictEncoder, FlattenMLP, QNetwork, build_encoder


@pytest.mark.parametrize("obs_shape, kind", [
    (4, MLP), ([4], MLP), ((3, 5), FlattenMLP), ((3, 16, 16), ConvEncoder), ((16, 16, 3), ConvEncoder),
    ({"a": 2, "b": (8, 8, 1)}, DictEncoder),
])
def test_build_encoder_picks_the_encoder_for_the_shape(obs_shape, kind):
    assert type(build_encoder(obs_shape, [8])) is kind


@pytest.mark.parametrize("obs_shape", [1, ()])
def test_scalar_observations_without_trailing_dim_are_encoded_per_env(obs_shape):
    enc = build_encoder(obs_shape, [8])
    assert enc(torch.tensor([0, 3, 5])).shape == (3, 8)
    assert enc(torch.tensor([2])).shape == (1, 8)
    torch.testing.assert_close(enc(torch.tensor([[2.0]])), enc(torch.tensor([2])))


def test_mlp_output_dim_matches_its_output():
    mlp = MLP(4, [32, 16])
    assert mlp(torch.zeros(5, 4)).shape == (5, mlp.output_dim) == (5, 16)
    assert MLP(4, [32], out_dim=3)(torch.zeros(2, 4)).shape == (2, 3)


def test_mlp_casts_integer_observations_to_float():
    assert MLP(3, [8])(torch.ones(2, 3, dtype=torch.int64)).dtype == torch.float32


def test_flatten_mlp_flattens_trailing_observation_dims_only():
    enc = FlattenMLP((3, 5), [8])
    assert enc(torch.zeros(7, 2, 3, 5)).shape == (7, 2, 8)


def test_conv_encoder_reads_hwc_uint8_and_chw_float_images_alike():
    chw = ConvEncoder((3, 12, 12), [16])
    hwc = ConvEncoder((12, 12, 3), [16])
    assert hwc.channels_last and not chw.channels_last
    hwc.load_state_dict(chw.state_dict())
    pixels = torch.randint(0, 256, (2, 12, 12, 3), dtype=torch.uint8)
    scaled_chw = pixels.permute(0, 3, 1, 2).float() / 255.0
    torch.testing.assert_close(hwc(pixels), chw(scaled_chw))


def test_conv_encoder_keeps_leading_dims_and_handles_atari_sized_frames():
    small = ConvEncoder((5, 5, 3), [16])
    assert small(torch.zeros(4, 2, 5, 5, 3, dtype=torch.uint8)).shape == (4, 2, 16)
    atari = ConvEncoder((4, 84, 84), [32])
    assert atari(torch.zeros(2, 4, 84, 84, dtype=torch.uint8)).shape == (2, 32)


def test_dict_encoder_concatenates_one_encoder_per_key():
    enc = DictEncoder({"vec": 3, "img": (6, 6, 3)}, [8])
    assert enc.output_dim == 16
    out = enc({"vec": torch.zeros(5, 3), "img": torch.zeros(5, 6, 6, 3, dtype=torch.uint8)})
    assert out.shape == (5, 16)
    vec_only = enc.encoders["vec"](torch.zeros(5, 3))
    torch.testing.assert_close(out[:, :8], vec_only)


def test_q_network_outputs_one_value_per_action():
    assert QNetwork(4, 3, hidden_sizes=[8])(torch.zeros(6, 4)).shape == (6, 3)


def test_dueling_head_mean_q_is_the_state_value():
    torch.manual_seed(0)
    net = QNetwork(4, 5, hidden_sizes=[8], dueling=True)
    obs = torch.randn(6, 4)
    q = net(obs)
    value_and_advantages = net.head(net.encoder(obs))
    assert q.shape == (6, 5)
    torch.testing.assert_close(q.mean(-1), value_and_advantages[:, 0])


def test_dueling_q_is_invariant_to_a_constant_shift_of_advantages():
    torch.manual_seed(0)
    net = QNetwork(4, 3, hidden_sizes=[8], dueling=True)
    obs = torch.randn(6, 4)
    before = net(obs)
    with torch.no_grad():
        net.head.bias[1:] += 10.0  # shift every advantage by the same constant
    torch.testing.assert_close(net(obs), before)


def test_dueling_q_is_value_plus_centred_advantages_and_adds_nothing_to_the_state_dict():
    net = QNetwork(4, 3, hidden_sizes=[8], dueling=True)
    obs = torch.randn(6, 4)
    out = net.head(net.encoder(obs))
    value, advantage = out[:, :1], out[:, 1:]
    torch.testing.assert_close(net(obs), value + advantage - advantage.mean(-1, keepdim=True))
    assert set(net.state_dict()) == set(QNetwork(4, 3, hidden_sizes=[8], dueling=False).state_dict())
