"""The GPU path, on each device this machine has: ``--device cuda`` trains with the learner on the GPU while
collectors act on CPU, checkpoints written on one device load on the other, acting outputs come back to the host
in one trip, and image encoders run under bf16 autocast on CUDA only. The ``cpu`` cases run everywhere; the
``cuda`` ones where torch sees a GPU (skipped elsewhere, saying why)."""
import copy
import json
import pickle

import numpy as np
import pytest
import torch

from conveyor.cli import main as cli_main
from conveyor.config import compile_config
from conveyor.data import to_host
from conveyor.middleware import load_checkpoint
from conveyor.policy import DQNPolicy, PPOPolicy
from conveyor.policy.encoders import NatureCNN
from conveyor.policy.normaliser import FrozenNormaliser
from conveyor.zoo import load_entry
from conveyor.run import train_distributed

from tests.cli_helpers import TINY

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def atari_ppo_config(device, **model):
    """atari/ppo's config for Breakout, compiled for ``device`` (the env's spaces filled in)."""
    cfg = copy.deepcopy(load_entry("atari/ppo").main_config)
    cfg.env.update(manager="sync", collector_env_num=2)
    cfg.policy.cuda = device == "cuda"
    cfg.policy.model.update(model)
    return compile_config(cfg, policy=PPOPolicy)


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_on_the_device_writes_a_checkpoint_that_loads_on_either_device(in_tmp, device, capsys):
    assert cli_main(["train", "cartpole/dqn", *TINY, "--device", device, "--exp-name", "dev"]) == 0, \
        capsys.readouterr().err
    saved = json.loads((in_tmp / "runs" / "dev" / "config.json").read_text())["config"]
    assert saved["policy"]["device"] == device
    state = load_checkpoint(in_tmp / "runs" / "dev" / "ckpt" / "final.pth.tar")["objects"]["policy"]
    obs = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    greedy = []
    for where in ("cpu", device, "cpu"):
        policy = DQNPolicy(saved["policy"], device=where)
        policy.load_state_dict(state)
        assert all(p.device.type == where for p in policy.model.parameters())
        greedy.append(policy.eval_mode.forward(obs)["action"])
        state = policy.state_dict()  # written on this device, read on the next
    assert all(isinstance(a, np.ndarray) for a in greedy)
    np.testing.assert_array_equal(greedy[0], greedy[1])
    np.testing.assert_array_equal(greedy[0], greedy[2])


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_distributed_the_learner_runs_on_the_device_and_the_collector_on_cpu(in_tmp, device):
    cfg = copy.deepcopy(load_entry("cartpole/dqn").main_config)
    cfg.policy.device = device
    run = train_distributed(load_entry("cartpole/dqn"), collectors=1, cfg=cfg, exp_name="dist", max_env_step=300,
                            progress=False)
    assert run.env_step >= 300 and run.train_iter > 0
    assert {node["role"]: torch.device(node["device"]).type for node in run.nodes} == \
        {"learner": device, "collector": "cpu"}


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_async_ppo_with_observation_statistics_learns_on_the_device_and_collects_in_a_cpu_process(in_tmp, device):
    cfg = copy.deepcopy(load_entry("pendulum/ppo").main_config)
    cfg.policy.cuda = device == "cuda"
    cfg.policy.model.hidden_sizes = [16, 16]
    cfg.policy.collect.n_sample = 64
    cfg.policy.learn.update(epoch_per_collect=1, batch_size=32)
    cfg.env.update(collector_env_num=2, evaluator_env_num=1, n_evaluator_episode=1)
    cfg.env.async_collector = "process"
    ctx = load_entry("pendulum/ppo").main(cfg, exp_name="async", max_env_step=256, async_mode=True, progress=False)
    assert ctx.env_step >= 256 and ctx.train_iter > 0
    state = load_checkpoint(in_tmp / "runs" / "async" / "ckpt" / "final.pth.tar")["objects"]["policy"]
    assert all(t.device.type == "cpu" for t in state["model"].values())  # read back onto the host


@pytest.mark.parametrize("device", DEVICES)
def test_acting_outputs_come_back_to_the_host_in_one_trip(device, monkeypatch):
    tensors = [torch.arange(6, device=device), torch.linspace(0, 1, 6, device=device), torch.ones(2, 3, device=device)]
    syncs = []
    if device == "cuda":
        synchronize = torch.cuda.Stream.synchronize
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: syncs.append(1) or synchronize(self))
    arrays = to_host(*tensors)
    assert len(syncs) == (1 if device == "cuda" else 0)
    for array, tensor in zip(arrays, tensors):
        assert isinstance(array, np.ndarray) and array.dtype == tensor.cpu().numpy().dtype
        np.testing.assert_array_equal(array, tensor.cpu().numpy())
    policy = PPOPolicy(atari_ppo_config(device).policy, seed=0)
    out = policy.collect_mode.forward(np.zeros((3, 4, 84, 84), np.uint8))
    assert {k: type(v) for k, v in out.items()} == {k: np.ndarray for k in ("action", "logp", "value",
                                                                           "weight_version")}
    assert out["action"].shape == out["logp"].shape == out["value"].shape == (3,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mixed_precision", [True, False])
def test_image_encoders_run_in_bf16_on_cuda_only_and_hand_float32_features_on(device, mixed_precision):
    policy = PPOPolicy(atari_ppo_config(device, mixed_precision=mixed_precision).policy, seed=0)
    encoders = [m for m in policy.model.modules() if isinstance(m, NatureCNN)]
    assert encoders
    conv_dtypes = []
    encoders[0].conv.register_forward_hook(lambda module, args, out: conv_dtypes.append(out.dtype))
    expect = torch.bfloat16 if device == "cuda" and mixed_precision else torch.float32
    assert all(e.autocast_dtype == (torch.bfloat16 if expect == torch.bfloat16 else None) for e in encoders)
    images = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8, device=device)
    features = encoders[0](images)
    assert conv_dtypes == [expect] and features.dtype == torch.float32
    features.sum().backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in encoders[0].parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_statistics_pickle_onto_the_host_and_move_to_a_replicas_device(device):
    frozen = FrozenNormaliser(torch.ones(3, device=device), torch.full((3,), 2.0, device=device), clip=5.0)
    sent = pickle.loads(pickle.dumps(frozen))
    assert sent.mean.device.type == "cpu" and sent.clip == 5.0
    assert torch.equal(sent(torch.zeros(1, 3)), torch.full((1, 3), -2.0))
    assert sent.to("cpu") is sent and sent.to(device).mean.device.type == device
