"""GreedyModule: a policy's greedy acting as a traced file takes observations as the env gives them (uint8 frames),
carries what the policy acts with besides its weights (the observation normaliser), and refuses what it cannot
express in one line."""
import numpy as np
import pytest
import torch

from conveyor.policy import DQNPolicy, GreedyModule, PPOPolicy

onnxruntime = pytest.importorskip("onnxruntime")


def _run_onnx(module, path, obs):
    module.save_onnx(path, obs[:2])
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session, session.run(None, {"obs": obs})[0]


def test_an_image_policy_exports_taking_uint8_frames_and_scales_them_inside(tmp_path):
    policy = PPOPolicy({"model": {"obs_shape": [4, 36, 36], "action_shape": 3}}, seed=0)
    frames = np.random.default_rng(0).integers(0, 256, (5, 4, 36, 36), dtype=np.uint8)
    session, action = _run_onnx(GreedyModule(policy, frames), tmp_path / "atari.onnx", frames)
    assert session.get_inputs()[0].type == "tensor(uint8)"
    assert session.get_inputs()[0].shape[0] == "batch"
    np.testing.assert_array_equal(action, policy.eval_mode.forward(frames)["action"])


def test_the_observation_normaliser_published_with_the_weights_is_part_of_the_file(tmp_path):
    policy = PPOPolicy({"model": {"obs_shape": 2, "action_shape": 2, "action_space": "gaussian", "hidden_sizes": [8],
                                  "obs_norm": True}}, seed=0)
    obs = np.random.default_rng(1).normal(5.0, 3.0, size=(16, 2)).astype(np.float32)
    policy.obs_normaliser.observe(torch.from_numpy(obs))
    policy.obs_normaliser.commit()
    policy.publish()  # acting now normalises by these statistics
    _, action = _run_onnx(GreedyModule(policy, obs), tmp_path / "normalised.onnx", obs)
    np.testing.assert_allclose(action, policy.eval_mode.forward(obs)["action"], atol=1e-5)
    with torch.no_grad():
        raw = policy.model.actor(torch.from_numpy(obs))[0].numpy()  # the same weights on unnormalised observations
    assert np.abs(action - raw).max() > 1e-3


def test_a_recurrent_policy_takes_and_returns_its_state_by_name():
    policy = PPOPolicy({"model": {"obs_shape": 4, "action_shape": 2, "rnn": "gru", "rnn_hidden_size": 8}}, seed=0)
    obs = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    module = GreedyModule(policy, obs)
    assert module.input_names == ("obs", "hidden") and module.output_names == ("action", "next_hidden")
    action, hidden = module(*module.inputs(obs))
    np.testing.assert_array_equal(action.numpy(), policy.eval_mode.forward(obs)["action"])
    assert hidden.shape == (3, 8)
    with pytest.raises(ValueError, match="takes obs and 1 state tensor"):
        module(torch.from_numpy(obs))


def test_dict_observations_are_refused_in_one_line_naming_what_exports():
    policy = DQNPolicy({"model": {"obs_shape": {"pos": 3, "goal": 2}, "action_shape": 2}}, seed=0)
    obs = {"pos": np.zeros((2, 3), np.float32), "goal": np.zeros((2, 2), np.float32)}
    with pytest.raises(ValueError, match="DQNPolicy acts on dict observations") as info:
        GreedyModule(policy, obs)
    assert "\n" not in str(info.value) and "single-agent policies on array observations" in str(info.value)
